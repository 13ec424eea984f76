"""Allocators for what a sequence owns: KV pages, a device row slot, an
adapter slot.

Check/action pairs (``can_allocate`` / ``allocate``): the scheduler asks
first and only then takes, so a refused admission leaves nothing half-taken.
Release is exactly once (I6): releasing an id that is not owned raises and
changes nothing, which is what makes a double free loud instead of silent.
"""

from __future__ import annotations

import attrs


class DoubleRelease(AssertionError):
    """An id was released that is not held: the I6 'exactly once' is broken."""


@attrs.define
class IdPool:
    """A pool of ``size`` interchangeable ids, handed out lowest first so that
    runs are reproducible (the same workload takes the same ids)."""

    name: str
    size: int
    _free: list[int] = attrs.field(init=False)
    _owned: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"{self.name}: size must be >= 0, got {self.size}")
        # A stack popped from the end: reversed so the lowest id comes first.
        self._free = list(range(self.size - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._owned)

    @property
    def num_owned(self) -> int:
        return len(self._owned)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int = 1) -> tuple[int, ...]:
        if n > len(self._free):
            raise RuntimeError(f"{self.name}: asked for {n}, only {len(self._free)} free")
        ids = tuple(self._free.pop() for _ in range(n))
        self._owned.update(ids)
        return ids

    def release(self, ids: tuple[int, ...]) -> None:
        missing = [i for i in ids if i not in self._owned]
        if missing or len(set(ids)) != len(ids):
            raise DoubleRelease(f"{self.name}: release of ids not held: {sorted(set(missing) or ids)}")
        self._owned.difference_update(ids)
        self._free.extend(sorted(ids, reverse=True))

    def check_integrity(self) -> None:
        """I6: free + owned == total, and no id is both."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"I6 {self.name}: an id is free twice")
        if free & self._owned:
            raise AssertionError(f"I6 {self.name}: ids both free and owned: {sorted(free & self._owned)}")
        if len(free) + len(self._owned) != self.size:
            raise AssertionError(
                f"I6 {self.name}: free {len(free)} + owned {len(self._owned)} != total {self.size}")


def pages_needed(prompt_len: int, max_tokens: int, page_size: int) -> int:
    """KV positions a sequence can ever write: the prompt, then every sampled
    token but the last (the last is committed, never fed back). Reserving this
    at admission means a running sequence never waits for a page, so the
    engine can neither deadlock nor need to preempt."""
    positions = prompt_len + max_tokens - 1
    return -(-positions // page_size)
