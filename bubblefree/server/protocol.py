"""uvicorn's HTTP/1.1 connection with its request heads bounded: the bytes
a request's line and headers may take, and the time they may take to
arrive.

uvicorn bounds neither in its httptools implementation, the one it picks
when httptools is installed: a client could send headers for ever, a byte
every few seconds (its keep-alive timer stops at the first byte) or
megabytes at a time, and be held open with its bytes in memory. Its h11
implementation caps a head's size (``h11_max_incomplete_event_size``), but
answers 400, bounds no time, and parses in pure Python where httptools
runs llhttp, in C. So this keeps httptools and adds both bounds in a
subclass, passed to uvicorn as its ``http`` protocol (``http_protocol``):

- time: a deadline, armed when the connection opens and again when a
  response ends on a kept-alive connection, disarmed when the next head is
  complete. Bytes do not push it back: a client sending a byte now and
  then is cut at the deadline, as one sending nothing is. Past it, 408 and
  the connection closed; closed alone where nothing came.
- size: the reads that fall wholly inside one head are counted; past the
  bound, 431 and the connection closed, so the parser holds at most the
  bound and two reads. A head that completes is measured whole by the
  guard (``guard.refusal``), from its parsed headers.

Neither runs while a request's body arrives (``--body-timeout`` bounds
that) or while its response is sent, however long it streams. This leans
on httptools' callbacks (``on_message_begin``, ``on_headers_complete``)
and on two of uvicorn's internals (``on_response_complete``, the
callback that ends a response; ``cycle.response_complete``, which its own
``shutdown`` reads); tests/test_server_headers.py fails if any moves.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import math
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bubblefree.server.errors import error_json
from bubblefree.server.guard import head_too_large
from bubblefree.server.settings import ServerSettings

logger = logging.getLogger("uvicorn.error")  # uvicorn's: --log-level applies


def http_protocol(settings: ServerSettings) -> Callable[..., asyncio.Protocol]:
    """What to pass as uvicorn's ``http``: it builds each connection's protocol."""
    return functools.partial(HeadBoundedProtocol, max_header_bytes=settings.max_header_bytes,
                             header_timeout_s=settings.header_timeout_s)


class HeadBoundedProtocol(HttpToolsProtocol):
    """One connection: uvicorn's, with a deadline on each head and a count
    of its bytes. A head pipelined behind a response still being sent is
    refused by closing alone (an answer written then would cut into that
    response's bytes), which ends that response too."""

    def __init__(self, *args: Any, max_header_bytes: int, header_timeout_s: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_header_bytes, self.header_timeout_s = max_header_bytes, header_timeout_s
        self._wire: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._heard = False  # bytes of a head came while the deadline ran: answer 408, not only close
        self._in_head = False  # the parser is inside a request's line and headers
        self._head_bytes = 0  # of that head, in reads that fell wholly inside it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wire = transport
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        inside = self._in_head
        super().data_received(data)
        # A read that began and ended inside one head is all head; one where
        # a head begins or ends also holds other bytes, and is not counted.
        if inside and self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                refused = head_too_large(self.max_header_bytes)
                self._refuse(refused.status, refused.message)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Unless a pipelined request, its head complete, starts now: the
        # connection waits for the next head.
        if not self._answering() and self._wire is not None and not self._wire.is_closing():
            self._arm()

    def _answering(self) -> bool:
        """A response is under way (uvicorn's ``shutdown`` asks the same)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._heard = self._in_head  # a pipelined head may have begun already
        if math.isfinite(self.header_timeout_s):
            self._deadline = asyncio.get_running_loop().call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._wire is None or self._wire.is_closing() or self._answering():
            return
        if self._heard:
            self._refuse(408, f"headers: not received within {self.header_timeout_s:g} s")
        else:
            self._wire.close()  # nothing came: as uvicorn ends an idle kept-alive connection

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` and close. Only close while a response is under
        way (the head was pipelined behind it): an answer would cut into it."""
        self._disarm()
        wire = self._wire
        if wire is None or wire.is_closing():
            return
        peer = wire.get_extra_info("peername")
        logger.warning("%s - %d: %s", "%s:%s" % peer[:2] if peer else "a client", status, message)
        if not self._answering():
            wire.write(_raw_answer(status, message))
        wire.close()


def _raw_answer(status: int, message: str) -> bytes:
    """The error in the app's JSON shape, with ``Connection: close``: written
    on the connection itself, no request having reached the app."""
    body = bytes(error_json(status, message, "headers").body)
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body
