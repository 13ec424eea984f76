"""Stable integer hashing for the simulated GPU: the same in every process
and run (splitmix64's mix), never Python's ``hash()``, which is salted per
process for strings and would make runs irreproducible."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit ints with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stable_hash(*parts: int) -> int:
    """A 64-bit hash of a few ints, the same in every process and run."""
    h = 0x5851F42D4C957F2D
    for p in parts:
        h = _mix(h ^ (p & _MASK64))
    return h
