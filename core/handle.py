"""A request as the core's caller holds it, on the thread that drives the core.

The core is single-threaded: a ``Handle`` is read and driven (``wait``,
iteration) by whoever ticks the engine. ``bubblefree``'s serving layer
keeps its own thread-safe handle and never exposes this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import attrs

from bubblefree.core.values import Request, Result

if TYPE_CHECKING:
    from bubblefree.core.engine import Engine

Listener = Callable[["Handle", "int | None"], None]


@attrs.define(eq=False)
class Handle:
    """A submitted request: streams tokens, then holds exactly one Result."""

    request_id: int
    request: Request
    _engine: "Engine"
    tokens: list[int] = attrs.Factory(list)
    result: Result | None = None
    listeners: list[Listener] = attrs.Factory(list)

    @property
    def done(self) -> bool:
        return self.result is not None

    def cancel(self) -> bool:
        return self._engine.cancel(self.request_id)

    def wait(self) -> Result:
        """Drive the engine in this thread until this request has ended. Only
        for an engine no other thread drives (``bubblefree``'s serving loop
        owns its engine: wait on a listener there instead)."""
        while self.result is None:
            if not self._engine.tick():
                raise RuntimeError(f"request {self.request_id}: engine idle before it ended")
        return self.result

    def __iter__(self) -> Iterator[int]:
        """Yield tokens as they are committed, driving the engine."""
        seen = 0
        while True:
            while seen < len(self.tokens):
                seen += 1
                yield self.tokens[seen - 1]
            if self.result is not None:
                return
            if not self._engine.tick():
                raise RuntimeError(f"request {self.request_id}: engine idle before it ended")
