"""Virtual time: the host clock, the two device queues, and copy deliveries.

Nothing here sleeps. Every duration is known when work is enqueued (the
caller's ``Timing`` chose it), so each queue computes start and end at once::

    host     ──launch──finalize─────────────wait(=copy end)──commit──►
    compute          [ forward t ][ sampling t ]·[ forward t+1 ]...      I1: FIFO
    copy                                        [ copy t ]              waits on t's event

The compute queue is one in-order stream (I1): an item starts when both the
host has enqueued it and the previous item has finished. A copy waits on an
``Event`` recorded after its sampling, and on the copy queue before it.

A copy's data reaches its host buffer only when the copy completes in
virtual time: ``deliver_at`` holds the write back until the host clock has
passed that instant, so a read before the copy ends sees nothing (I4).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import attrs


@attrs.frozen
class Event:
    """Recorded on the compute queue; fires when the work before it ends."""

    step_id: int
    time: float


@attrs.define
class Queue:
    """One in-order device stream."""

    name: str
    free_at: float = 0.0
    # (step_id, what, start, end) in enqueue order, which is execution order.
    intervals: list[tuple[int, str, float, float]] = attrs.Factory(list)

    def enqueue(self, step_id: int, what: str, ready_at: float, duration: float) -> tuple[float, float]:
        start = max(ready_at, self.free_at)
        end = start + duration
        self.free_at = end
        self.intervals.append((step_id, what, start, end))
        return start, end


@attrs.define
class Clock:
    host: float = 0.0
    compute: Queue = attrs.Factory(lambda: Queue("compute"))
    copy: Queue = attrs.Factory(lambda: Queue("copy"))
    # Heap of (time, tie-break, write): host-buffer writes not yet landed.
    _pending: list[tuple[float, int, Callable[[], None]]] = attrs.Factory(list)
    _order: itertools.count = attrs.Factory(itertools.count)

    def spend(self, cost: float) -> tuple[float, float]:
        """The host does ``cost`` of CPU work; returns its interval."""
        start = self.host
        self.host = start + cost
        self._land()
        return start, self.host

    def wait_until(self, time: float) -> None:
        """Block the host until ``time`` (an event's completion), no earlier."""
        self.host = max(self.host, time)
        self._land()

    def record(self, step_id: int) -> Event:
        """An event after everything enqueued on the compute queue so far."""
        return Event(step_id, self.compute.free_at)

    def deliver_at(self, time: float, write: Callable[[], None]) -> None:
        heapq.heappush(self._pending, (time, next(self._order), write))
        self._land()

    def _land(self) -> None:
        while self._pending and self._pending[0][0] <= self.host:
            _, _, write = heapq.heappop(self._pending)
            write()
