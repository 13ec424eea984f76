"""Kernel launch settings written as short strings (``4x32w4s1``,
``64n128k4s4w3p``), as benchmarks and tuning tools name them."""

from __future__ import annotations

import re


def parse_settings(cls, pattern: str, what: str, expected: str, text: str,
                   powers_of_two: tuple[str, ...]):
    """``cls`` from the integers ``pattern`` captures in ``text``; a clear
    error naming ``text`` when it does not match or when a field in
    ``powers_of_two`` is not one."""
    m = re.fullmatch(pattern, text.strip())
    if m is None:
        raise ValueError(f"{what} {text!r}: expected {expected}")
    out = cls(*map(int, m.groups()))
    for name in powers_of_two:
        n = getattr(out, name)
        if n < 1 or n & (n - 1):
            raise ValueError(f"{what} {text!r}: {name} must be a power of two, not {n}")
    return out
