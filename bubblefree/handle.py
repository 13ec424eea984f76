"""A submitted request as a caller holds it: safe from any thread.

The core's ``Handle`` belongs to the decode thread. This one is what
``Engine.submit`` returns: its state is written only by the decode thread
(through the core's listeners, after each tick) and read by anyone, under a
condition variable; cancelling goes through the serving loop's one door.

A wait (``result()``, iteration) from the decode thread itself, that is
from inside a listener, would wait for the thread that is running it: it
raises ``RuntimeError`` at once instead of deadlocking.
"""

from __future__ import annotations

import numbers
import threading
from typing import TYPE_CHECKING, Any, Iterator

from bubblefree.core import Request, Result, Status
from bubblefree.core.values import shown

if TYPE_CHECKING:
    from bubblefree.loop import ServingLoop


class RequestFailed(RuntimeError):
    """A request ended without completing: cancelled, or failed with a reason.
    ``result`` holds what was committed before the end."""

    def __init__(self, result: Result):
        super().__init__(f"request {result.request_id} {result.status.value}: {result.finish_reason}")
        self.result = result


def wait_seconds(timeout: Any) -> float | None:
    """A wait's ``timeout`` as the locks take it: None (no limit) or seconds
    >= 0; infinity is no limit. A clear ``ValueError`` for anything else: a
    NaN never times out, so a wait on it would spin on the handle's lock.
    Beyond what a lock can time (``threading.TIMEOUT_MAX``, some 292 years)
    is no limit too: a lock refuses a longer wait with ``OverflowError``."""
    if timeout is None:
        return None
    # NaN is the one number unequal to itself; math.isnan would first make an
    # int a float, which overflows for an int past any float.
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or timeout != timeout or timeout < 0:
        raise ValueError(f"timeout: seconds >= 0 or None, not {shown(timeout)}")
    # Half the lock's limit: the condition re-derives what is left from a
    # clock, which may round a wait near the limit just past it.
    return None if timeout > threading.TIMEOUT_MAX / 2 else float(timeout)


NOT_COPIED = "a Handle is one request's; share the Handle itself, not a copy"


class Handle:
    def __init__(self, request_id: int, request: Request, loop: "ServingLoop"):
        self.request_id = request_id
        self.request = request
        self._loop = loop
        self._tokens: list[int] = []
        self._result: Result | None = None
        # One lock, two conditions: a thread waiting for the result is woken
        # once, at the end, not on every token (32 waiting clients woken per
        # step would take the GIL from the decode thread 32 times a step).
        lock = threading.Lock()
        self._changed = threading.Condition(lock)  # a token or the end: iterators
        self._ended = threading.Condition(lock)  # the end only: result()
        self._iterators = 0  # threads waiting on _changed (no token wakes nobody)
        self._engine: Any = None  # held while live (``_keep_until_done``)

    # A copy would share the token list but not the conditions the decode
    # thread notifies, so its result() would wait for ever; a pickle could
    # not reach the decode thread at all. Refused, all three, saying so.
    def __copy__(self) -> "Handle":
        raise TypeError(NOT_COPIED)

    def __deepcopy__(self, memo: dict) -> "Handle":
        raise TypeError(NOT_COPIED)

    def __reduce__(self) -> Any:
        raise TypeError(NOT_COPIED)

    def __repr__(self) -> str:
        state = "live" if self._result is None else self._result.status.value
        return f"<Handle {self.request_id} {state}, {len(self._tokens)} tokens>"

    # -------------------------------------------------------------- reading
    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens committed so far."""
        with self._changed:
            return tuple(self._tokens)

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the one Result (I7). ``TimeoutError`` if it is not there
        within ``timeout`` seconds (the request goes on)."""
        seconds = wait_seconds(timeout)
        with self._ended:
            if self._result is None:
                self._loop.refuse_wait_on_loop_thread("Handle.result()")
                if not self._ended.wait_for(lambda: self._result is not None, seconds):
                    raise TimeoutError(f"request {self.request_id}: no result within {timeout} s")
            return self._result

    def output(self, timeout: float | None = None) -> Any:
        """The skill's result, or ``RequestFailed`` if the request did not complete."""
        result = self.result(timeout)
        if result.status is not Status.COMPLETED:
            raise RequestFailed(result)
        return result.output

    def __iter__(self) -> Iterator[int]:
        """Tokens as they are committed; ``RequestFailed`` at the end if the
        request was cancelled or failed, so a cut answer never passes for a
        whole one."""
        seen = 0
        while True:
            with self._changed:
                if seen == len(self._tokens) and self._result is None:
                    self._loop.refuse_wait_on_loop_thread("iterating a Handle")
                    self._iterators += 1
                    try:
                        self._changed.wait_for(lambda: seen < len(self._tokens) or self._result is not None)
                    finally:
                        self._iterators -= 1
                fresh, result = self._tokens[seen:], self._result
            seen += len(fresh)
            yield from fresh
            if result is not None and seen == len(result.tokens):
                if result.status is not Status.COMPLETED:
                    raise RequestFailed(result)
                return

    # ------------------------------------------------------------- control
    def cancel(self) -> bool:
        """Cancel from any thread. False when the request had already ended;
        True means the cancel was taken, and the Result says how it ended
        (a request may still complete if its last token was already out)."""
        return self._loop.cancel(self)

    def _keep_until_done(self, engine: Any) -> None:
        """Hold ``engine`` while the request is live: an engine closes when
        it is collected, and ``make_engine().stream(...)`` holds only the
        stream. Let go at the end, so a finished handle keeps nothing alive."""
        with self._changed:
            if self._result is None:
                self._engine = engine

    # ---------------------------------------- written by the decode thread
    def _push(self, token: int | None, result: Result | None) -> None:
        # Per committed token on the decode thread's hot path: wake only
        # threads that wait for tokens, and only when there are any.
        with self._changed:
            if token is not None:
                self._tokens.append(token)
                if self._iterators:
                    self._changed.notify_all()
            if result is not None and self._result is None:
                self._result, self._engine = result, None
                self._ended.notify_all()
                self._changed.notify_all()
