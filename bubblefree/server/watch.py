"""A request's work raced against its client leaving and its deadline.

Starlette notices a client that left only when it next writes, which for a
request waiting on a long prefill or a full queue may be never; the engine
would decode for nobody. Here the work runs as a task beside one that waits
for ``http.disconnect``: whichever ends first decides. Cancelling the work
task cancels the engine request (the serving layer cancels on abandonment),
so its KV pages come back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from bubblefree.server.errors import ApiError

# How a stream ended, as ``EventStream`` tells its ``on_end``: its events ran
# to their end (the request's own end, a failure's event included); its client
# left; its deadline (504) or the server's shutdown (503) cut it; a bug did.
ENDINGS = ("finished", "client_left", "deadline", "shutdown", "error")

# The most a stream's last events (its end, or the error that ends it) wait
# on a reader that stopped reading: its request has ended by then, and its
# slot is free; past it the server gives up on the connection.
TAIL_S = 5.0


class ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def stopping() -> ApiError:
    """The answer to a request the server cut: it is shutting down (uvicorn
    cancels what is still running once its grace period ends)."""
    return ApiError(503, "server: shutting down; this request was cancelled before its answer",
                    "server", headers={"Retry-After": "1"})


def internal_error(err: BaseException) -> ApiError:
    """The answer to a bug: the 500 in the one JSON shape, naming only the
    exception's type (the traceback goes to the log)."""
    return ApiError(500, f"server: an internal error ({type(err).__name__}); the request did not complete",
                    "server", headers={"Connection": "close"})


async def watched(receive: Receive, work: Awaitable[Any], timeout: float) -> Any:
    """``await work``, cancelled when the client leaves (``ClientGone``) or
    after ``timeout`` seconds (504). If the server cancels the request
    itself (shutting down), the work is cancelled and a 503 raised, so the
    client still gets an answer in the API's shape."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(receive))
    cut = False
    try:
        await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cut = True
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # answered here: the cancel has done its work
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if cut:
        raise stopping()
    if not task.cancelled() and task.done():
        return task.result()
    if gone.done() and not gone.cancelled():
        raise ClientGone()
    raise ApiError(504, f"request: not finished within {timeout:g} s; cancelled", "request")


class EventStream(Response):
    """Server-sent events from ``events`` (dicts, or ``"[DONE]"``), with the
    same race: a client that leaves cancels the stream (and so the engine
    request); the deadline (504), the server shutting down (503) or a bug
    (500) ends it with ``ending(error)``'s events, the API's error event.

    ``on_end(how)`` runs once, as soon as the events end, however they
    ended (``ENDINGS``): before the last events are written, since those
    wait on the reader. A reader that stops reading so holds neither its
    slot nor its engine request past the deadline, and the connection at
    most ``TAIL_S`` more."""

    def __init__(self, events: AsyncIterator[Any], timeout: float,
                 ending: Callable[[ApiError], list[Any]], on_end: Callable[[str], None]):
        # A Response only so that FastAPI hands it on untouched; it writes itself.
        self.status_code, self.background = 200, None
        self.events, self.timeout = events, timeout
        self.ending, self.on_end = ending, on_end
        self._ended = False
        self._how = "client_left"  # until the events run: the first write failed, or was cut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send = _connection(send)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            tail, bug = await self._run(receive, send)
            try:
                await asyncio.wait_for(self._write_tail(send, tail), TAIL_S)
            except asyncio.TimeoutError:
                pass  # nobody reads: uvicorn closes a response left incomplete
            if bug is not None:
                raise bug  # logged, and the connection closed, as a route's bug is
        except (ClientGone, OSError):
            pass  # nobody to write to; the engine request is already cancelled
        finally:
            await self._end()

    async def _run(self, receive: Receive, send: Send) -> tuple[list[Any], Exception | None]:
        """Pump the events until they end; the last events to write, and the
        bug that ended them if one did. The request ends here (``_end``)."""
        try:
            await watched(receive, self._pump(send), self.timeout)
            self._how = "finished"
            return [], None
        except ApiError as err:  # the deadline, or shutting down
            self._how = "deadline" if err.status == 504 else "shutdown"
            return self.ending(err), None
        except (ClientGone, OSError):
            self._how = "client_left"
            raise
        except Exception as err:  # a bug mid-stream: its 500, as the stream's last event
            self._how = "error"
            return self.ending(internal_error(err)), err
        finally:
            await self._end()

    async def _pump(self, send: Send) -> None:
        async for event in self.events:
            await send(_frame(event))

    async def _write_tail(self, send: Send, events: list[Any]) -> None:
        for event in events:
            await send(_frame(event))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end(self) -> None:
        """Once: the slot back and the engine request cancelled (``on_end``),
        then the events closed."""
        if self._ended:
            return
        self._ended = True
        try:
            self.on_end(self._how)
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]


def _connection(send: Send) -> Send:
    """``send``, a failure of its connection as ``ClientGone``: a write to a
    transport the client closed raises ``OSError`` under asyncio's loop
    but ``RuntimeError`` under uvloop's, which counted as a bug (a stream
    ended "error", an exception logged) before the disconnect was heard."""
    async def sent(message: dict) -> None:
        try:
            await send(message)
        except RuntimeError as err:
            raise ClientGone() from err
    return sent


def _frame(event: Any) -> dict:
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True}
