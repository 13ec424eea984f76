"""The checks every HTTP request passes before a route sees it: the size of
its head, the API key and the body size; the count of answers by route
and status; and the 503 for a request the server's shutdown cut before
its answer began.

A pure ASGI middleware, so a body over the limit is refused from its
``Content-Length`` before any of it is read, and one that lies about its
length (or sends none) stops being read at the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import attrs
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bubblefree.server.errors import ApiError, error_body
from bubblefree.server.observe import Observer
from bubblefree.server.settings import ServerSettings
from bubblefree.server.watch import stopping

OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no key
CLIENT_GONE = 499  # recorded for a request whose client left before its answer
SERVER_ERROR = 500  # recorded for one whose route raised before answering


class Guard:
    def __init__(self, app: ASGIApp, settings: ServerSettings, observer: Observer):
        self.app, self.settings, self.observer = app, settings, observer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        count = _Count(self.observer, scope["path"])
        send = count.sending(send)
        refused = refusal(scope, self.settings)
        if refused is not None:
            await _respond(refused, send)
            return
        try:
            await self.app(scope, count.hearing(limited(receive, self.settings)), send)
        except asyncio.CancelledError:
            if count.status is not None:
                raise  # mid-answer: nothing to say; uvicorn closes the connection
            # The server cut the request before its answer began (uvicorn
            # cancels what still runs once its shutdown grace ends): while it
            # read its body, decoded its image, tokenized. ``watched``
            # answers those waiting on the engine; this, all the others.
            # Unanswered, uvicorn sent a plain-text 500 and this counted 499.
            _uncancel()
            if not count.left:
                await _respond(stopping(), send)
        except Exception as err:
            # Raised before an answer: the server failed (the error
            # middleware outside answers 500), unless the client went away.
            count.once(CLIENT_GONE if isinstance(err, (OSError, ClientDisconnect)) else SERVER_ERROR)
            raise
        finally:
            count.once(CLIENT_GONE)


@attrs.define
class _Count:
    """One request's count, once: at its answer's start, or as gone if none
    began. A client heard leaving before its answer began is counted as
    gone, whatever the route then answered nobody (a body cut short, 400)."""

    observer: Observer
    path: str
    status: int | None = None  # counted
    left: bool = False  # its disconnect was heard

    def once(self, status: int) -> None:
        if self.status is None:
            self.status = CLIENT_GONE if self.left else status
            self.observer.answered(self.path, self.status)

    def sending(self, send: Send) -> Send:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.once(message["status"])
            await send(message)
        return counted

    def hearing(self, receive: Receive) -> Receive:
        async def heard() -> Message:
            message = await receive()
            self.left = self.left or message["type"] == "http.disconnect"
            return message
        return heard


def _uncancel() -> None:
    """The cancel is answered here: it has done its work (as ``watched``'s)."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def refusal(scope: Scope, settings: ServerSettings) -> ApiError | None:
    """What refuses a request from its headers alone: a head over its limit,
    the API key, then a ``Content-Length`` over the body limit. The Ray
    relay asks it too, so a request gets the same answer through the relay
    as from one server."""
    if head_bytes(scope) > settings.max_header_bytes:
        return head_too_large(settings.max_header_bytes)
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    key = settings.api_key
    if key is not None and scope["path"] not in OPEN_PATHS:
        given = headers.get("x-moondream-auth") or _credentials(headers.get("authorization", ""))
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            return ApiError(401, "api key: missing or wrong; send Authorization: Bearer <key>",
                            "authorization", headers={"WWW-Authenticate": "Bearer"})
    length = headers.get("content-length", "")
    if length.isdigit() and int(length) > settings.max_body_bytes:
        return _too_large(settings.max_body_bytes)
    return None


def head_bytes(scope: Scope) -> int:
    """A request's line and headers in bytes, as sent without optional
    whitespace. Measured here once they are parsed: the HTTP protocol
    (``protocol.py``) bounds a head still arriving, but cannot tell where
    one ends inside a read."""
    target = len(scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape"))
    query = len(scope.get("query_string", b""))
    line = len(scope["method"]) + 1 + target + (query + 1 if query else 0) + len(" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


def head_too_large(limit: int) -> ApiError:
    # Connection: close, as when the protocol refuses a head still arriving:
    # the same answer wherever the bound caught it.
    return ApiError(431, f"headers: larger than this server's limit of {limit} bytes", "headers",
                    headers={"Connection": "close"})


def api_key_refusal(key: str) -> str | None:
    """Why ``key`` cannot serve as the API key, or None. An empty key (an
    unset variable) would leave the server open while its operator thinks
    it closed; a client sends a header as printable ASCII with the
    surrounding whitespace dropped, so a key with either could never match."""
    if not key:
        return "empty; give a key, or leave the option out for an open server"
    if key != key.strip():
        return "has whitespace around it, which no client's header keeps"
    if not (key.isascii() and key.isprintable()):
        return "must be printable ASCII (a header carries no other characters)"
    return None


def limited(receive: Receive, settings: ServerSettings) -> Receive:
    """``receive`` with the body's bounds: its size, and the time it may
    take to arrive, whole (a client that sends part of a body and goes
    quiet held its connection for ever); past either it raises the
    ``ApiError`` to answer (413, 408). Once the body is in, a receive waits
    as long as it must (a route watching for the client to leave)."""
    limit, seen, body_done = settings.max_body_bytes, [0], [False]
    wait, deadline = settings.body_timeout_s, []

    async def bounded() -> Message:
        if body_done[0]:
            return await receive()
        if not deadline:  # the whole body within ``wait`` of the route's first read
            deadline.append(asyncio.get_running_loop().time() + wait)
        try:
            message = await asyncio.wait_for(receive(), deadline[0] - asyncio.get_running_loop().time())
        except asyncio.TimeoutError:
            raise ApiError(408, f"body: not received within {wait:g} s", "body") from None
        if message["type"] == "http.request":
            seen[0] += len(message.get("body", b""))
            if seen[0] > limit:
                raise _too_large(limit)  # raised inside the route's body read: answered as 413
            body_done[0] = not message.get("more_body", False)
        else:
            body_done[0] = True
        return message
    return bounded


def _credentials(authorization: str) -> str:
    """The key in an Authorization header: after the Bearer scheme, whose
    name is case-insensitive (RFC 9110, 11.1), or the whole value."""
    scheme, _, token = authorization.strip().partition(" ")
    return token if scheme.lower() == "bearer" else authorization


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"body: larger than this server's limit of {limit} bytes", "body")


async def _respond(err: ApiError, send: Send) -> None:
    body = json.dumps(error_body(err.status, err.message, err.param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
