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
- a client that pipelined a request behind one still running, then left:
  uvicorn pauses reading once a request is queued so, reading nothing, it
  never saw the connection end; and it holds only the queued request's
  cycle (``self.cycle``), so only that one would have been told. The
  running request held its live slot and its KV pages to the deadline.
  While a request is queued the socket is asked every ``HANGUP_CHECK_S``
  whether the peer hung up (``hung_up``), and at the connection's end
  every cycle not yet answered is told.

Neither runs while a request's body arrives (``--body-timeout`` bounds
that) or while its response is sent, however long it streams. This leans
on httptools' callbacks (``on_message_begin``, ``on_headers_complete``)
and on uvicorn's internals (``on_response_complete``, the callback that
ends a response; ``cycle.response_complete``, which its own ``shutdown``
reads; ``cycle.disconnected`` and ``cycle.message_event``, which its own
``connection_lost`` sets; ``cycle.response_started``; ``send_400_response``,
its answer to bytes the parser refuses, here in the JSON error shape;
``self.url`` and ``self.headers``, which tell a URL too long for httptools,
a 431 or 414); tests/test_server_headers.py,
tests/test_server_protection.py and tests/test_server_lifecycle_fixes.py
fail if any moves.
"""

from __future__ import annotations

import asyncio
import functools
import http
import logging
import math
import os
import select
import socket
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bubblefree.server.errors import error_json
from bubblefree.server.guard import head_too_large
from bubblefree.server.settings import ServerSettings

logger = logging.getLogger("uvicorn.error")  # uvicorn's: --log-level applies

# How often a connection that reads nothing (a request queued behind a
# running one) is asked whether its client hung up.
HANGUP_CHECK_S = 0.25
# The longest URL httptools' parse_url takes (its offsets are 16-bit).
MAX_URL_BYTES = 65535


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
        self._cycles: list[Any] = []  # requests begun and not answered: each hears the disconnect
        self._hangup: asyncio.TimerHandle | None = None  # the check while reading is paused

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wire = transport
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._hangup is not None:
            self._hangup.cancel()
            self._hangup = None
        super().connection_lost(exc)
        for cycle in self._cycles:  # as uvicorn tells its latest
            if not cycle.response_complete:
                cycle.disconnected = True
            cycle.message_event.set()
        self._cycles.clear()

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
        self._cycles = [c for c in self._cycles if not c.response_complete]
        if self.cycle is not None:
            self._cycles.append(self.cycle)
        if self.pipeline and self._hangup is None:  # queued: uvicorn reads no more until it starts
            self._hangup = asyncio.get_running_loop().call_later(HANGUP_CHECK_S, self._check_hangup)

    def _check_hangup(self) -> None:
        self._hangup = None
        wire = self._wire
        if wire is None or wire.is_closing() or not self.pipeline:
            return
        if hung_up(wire):
            wire.close()  # connection_lost follows, and tells every cycle
        else:
            self._hangup = asyncio.get_running_loop().call_later(HANGUP_CHECK_S, self._check_hangup)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Unless a pipelined request, its head complete, starts now: the
        # connection waits for the next head.
        if not self._answering() and self._wire is not None and not self._wire.is_closing():
            self._arm()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses (a malformed request
        line, header or body framing), in the one JSON error shape rather
        than its plain text; and, once a response has begun (the bytes
        were pipelined behind it), the connection closed alone, as
        ``_refuse`` does: an answer would cut into it. A request whose body
        the parser refused has none begun: it hears the disconnect."""
        wire = self._wire
        if wire is None or wire.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            status, message, param = self._long_url() or (
                400, "request: not valid HTTP/1.1 (its request line, a header or its body's framing)", "request")
            wire.write(_raw_answer(status, message, param))
        wire.close()

    def _long_url(self) -> tuple[int, str, str] | None:
        """The refusal of a URL longer than httptools parses, or None. Its
        ``parse_url`` (which uvicorn calls once the head is in) refuses one
        over ``MAX_URL_BYTES``, and uvicorn answered that as bytes not HTTP:
        a head that came in few reads was over the size bound, but the
        count of reads inside it had not passed it. Past the bound it is
        the bound's 431; within a bound set higher, 414, the URL's own."""
        url = getattr(self, "url", b"")  # uvicorn sets it at a message's first byte, not before
        if len(url) <= MAX_URL_BYTES:
            return None
        line = len(url) + len("GET  HTTP/1.1\r\n")  # the shortest method: the head is at least this
        if line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2 > self.max_header_bytes:
            refused = head_too_large(self.max_header_bytes)
            return refused.status, refused.message, "headers"
        return 414, f"url: longer than {MAX_URL_BYTES} bytes, the most this server parses", "url"

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


def hung_up(wire: asyncio.Transport) -> bool:
    """Whether the peer closed its side, read without consuming a byte: the
    kernel's hang-up flag where it has one (Linux), which sees the end behind
    bytes not yet read; else a peek, which sees it only where none wait."""
    sock = wire.get_extra_info("socket")
    if sock is None:
        return False
    try:
        fd = sock.fileno()
        if fd < 0:
            return True
        if hasattr(select, "POLLRDHUP"):
            poller = select.poll()
            poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return bool(poller.poll(0))
        raw = socket.socket(fileno=os.dup(fd))
        try:
            raw.setblocking(False)
            return raw.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        finally:
            raw.close()
    except OSError:
        return True


def _raw_answer(status: int, message: str, param: str = "headers") -> bytes:
    """The error in the app's JSON shape, with ``Connection: close``: written
    on the connection itself, no request having reached the app."""
    body = bytes(error_json(status, message, param).body)
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body
