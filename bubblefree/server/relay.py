"""The relay of ``serve --replicas`` (``replicas.py``): the HTTP ingress in
front of the engine replicas. It refuses what the app's guard would refuse
from the headers, reads a request's body within the server's bounds, hands
the request to a replica through Ray's handle and relays the answer's ASGI
messages as they come; a replica's death becomes the server's 503 or a last
error event. At shutdown ``drain`` refuses new requests with a 503 naming
the shutdown, lets those taken finish within the grace and cuts the rest.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any, AsyncIterator, Callable

import attrs
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message

from bubblefree.server.errors import ApiError, ErrorJSON, error_body, error_json, error_response
from bubblefree.server.guard import limited, refusal
from bubblefree.server.settings import ServerSettings
from bubblefree.server.watch import stopping

# How long a draining relay waits for the answers of the requests it cut
# past the grace: a cancelled call ends in milliseconds.
CUT_S = 2.0
# What of an ASGI scope travels to a replica: plain values only.
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "server", "client")


@attrs.define(eq=False)
class _Taken:
    """A request a relay has taken and not yet answered in full, and its
    call to a replica once made: what ``Relay.drain`` waits for, or cuts."""

    messages: Any = None


class Relay:
    """The HTTP ingress: one request, relayed to one replica; ``drain`` at
    shutdown."""

    def __init__(self, replicas: Any, settings: ServerSettings):
        self.replicas = replicas.options(stream=True)
        self.settings = settings
        self.draining = False  # set by ``drain``: from then on every new request is refused
        self.live: set[_Taken] = set()

    async def __call__(self, request: Request) -> Response:
        if self.draining:
            return error_response(shutting_down())
        taken = _Taken()
        self.live.add(taken)
        streaming = False
        try:
            response = await self._relay(request, taken)
            streaming = isinstance(response, _Relayed)
            return response
        finally:
            if not streaming:  # a stream is answered once its sending ends: ``_Relayed`` says when
                self.live.discard(taken)

    async def _relay(self, request: Request, taken: _Taken) -> Response:
        # The replica's guard would refuse these too; no need to carry them there.
        refused = refusal(request.scope, self.settings)
        if refused is not None:
            return error_response(refused)
        receive, body = limited(request.receive, self.settings), bytearray()
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":  # gone before its body was in: no replica had it
                    return Response(status_code=499)
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        except ApiError as err:  # too large (413), or too slow to arrive (408)
            return error_response(err)
        scope = {k: request.scope[k] for k in _SCOPE_KEYS if k in request.scope}
        messages = taken.messages = self.replicas.http.remote(scope, bytes(body))
        try:
            start = await messages.__anext__()
        except StopAsyncIteration:
            return unavailable("the replica ended the request without an answer")
        except asyncio.CancelledError:
            messages.cancel()
            raise
        except Exception as err:  # noqa: BLE001 - the replica died or could not be reached; or ``drain`` cut it
            if cut(err):
                return error_response(stopping())
            return unavailable(f"the replica serving this request stopped ({type(err).__name__}); retry")
        headers = dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers", []))
        if not headers.get("content-type", "").startswith("text/event-stream"):
            return await _whole(messages, start)
        response = _Relayed(messages, functools.partial(self.live.discard, taken),
                            start["status"])
        response.raw_headers = [(k, v) for k, v in start.get("headers", [])
                                if k.lower() != b"content-length"]
        return response

    async def drain(self, grace_s: float) -> None:
        """Shutting down (``stop`` calls it on every relay): refuse every new
        request, let those taken run for up to ``grace_s``, then cut the
        calls still running (cancelled, as when a client leaves, so their
        engine requests end) and return once they are answered."""
        self.draining = True
        await self._answered(grace_s)
        for taken in list(self.live):
            if taken.messages is not None:
                taken.messages.cancel()
        await self._answered(CUT_S)

    async def _answered(self, within_s: float) -> None:
        """Until every request taken is answered, for at most ``within_s``."""
        deadline = time.monotonic() + within_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


async def _whole(messages: Any, start: Message) -> Response:
    """A JSON answer, gathered whole before anything is sent: complete, or a
    503 naming the replica when it died part way (never a body cut short).
    Sent as one plain response: a streamed one would also listen for the
    client's disconnect on Ray Serve's receive channel, whose cancellation
    at the end of the answer Ray logs as a traceback."""
    body, done = bytearray(), False
    try:
        async for message in messages:
            if message["type"] == "http.response.body":
                body += message.get("body", b"")
                done = not message.get("more_body", False)
    except asyncio.CancelledError:  # the client left: the replica stops its request
        messages.cancel()
        raise
    except Exception as err:  # noqa: BLE001 - the replica died or its code raised mid-answer
        # An answer already whole stands: Starlette's error middleware sends
        # a route's bug as the JSON 500, then raises it again.
        if not done:
            status, message, param = failure(err)
            return error_json(status, message, param,
                              {"Retry-After": "1"} if status == 503 else None)
    response = Response(bytes(body), status_code=start["status"])
    response.raw_headers = list(start.get("headers", []))
    return response


class _Relayed(StreamingResponse):
    """A replica's streamed answer, relayed (``_bodies``). However its
    sending ends, the replica's call is cancelled (a no-op once the answer
    is complete), its events are closed and ``ended()`` runs: also when the
    client leaves before the first event, where the events were never
    started (their own ``finally`` never runs), or when a send to a client
    gone raises and leaves them suspended until collected. Before, such a
    request stayed counted until a drain's grace ran out, and the relay
    never cancelled its replica's call."""

    def __init__(self, messages: Any, ended: Callable[[], None], status_code: int):
        self._events = _bodies(messages)
        super().__init__(self._events, status_code=status_code)
        self._messages, self._ended = messages, ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._messages.cancel()
            self._ended()
            await self._events.aclose()


async def _bodies(messages: Any) -> AsyncIterator[bytes]:
    """A streamed answer's events; an error event when the replica dies
    part way. The call is cancelled once they end, however they end
    (``_Relayed`` does it too, where they never start)."""
    try:
        async for message in messages:
            if message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - the replica died or its code raised mid-answer
        event = error_body(*failure(err))
        yield f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    finally:
        messages.cancel()  # a no-op once the answer is complete; else the client left


def failure(err: Exception) -> tuple[int, str, str]:
    """What to tell a client whose answer broke off with ``err``: its status,
    message and field. The replica's own code raising (Ray hands it on as a
    ``RayTaskError``) is a bug, a 500 as one server words it; anything else
    (the actor died, or could not be reached) is the replica gone, a 503
    worth a retry; a call ``drain`` cut is the server shutting down, as
    one server says it."""
    from ray.exceptions import RayTaskError

    if cut(err):
        return 503, stopping().message, "server"
    if isinstance(err, RayTaskError):
        cause = type(err.cause).__name__ if err.cause is not None else type(err).__name__
        return 500, f"server: an internal error ({cause}); the request did not complete", "server"
    return (503, f"replica: the replica serving this request stopped ({type(err).__name__}) "
                 "before the end; retry", "replica")


def cut(err: Exception) -> bool:
    """Whether ``err`` ended a call the relay cancelled: while it still
    reads an answer, only ``drain`` does."""
    from ray.serve.exceptions import RequestCancelledError

    return isinstance(err, RequestCancelledError)


def shutting_down() -> ApiError:
    """The answer to a request that reaches a draining relay: the server
    is shutting down; another server, or this one once back, takes it."""
    return ApiError(503, "server: shutting down; not taking new requests", "server",
                    headers={"Retry-After": "1"})


def unavailable(why: str) -> ErrorJSON:
    return error_json(503, f"replica: {why}", "replica", {"Retry-After": "1"})
