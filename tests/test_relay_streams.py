"""The relay's streamed answers (``server/relay.py``, ``serve --replicas``):
however sending one ends (its events done, the client gone before the first
event, a send to a client gone raising, a cancel mid-stream) the replica's
call is cancelled, the events are closed and the relay stops counting the
request, so a drain at shutdown does not wait out its grace for it. Under
both ways Starlette learns of a disconnect: a listener on ``receive``
(ASGI below 2.4) and a send that raises (2.4 on)."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import ClientDisconnect

from bubblefree.server import ServerSettings
from bubblefree.server.relay import Relay, _Relayed

START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"text/event-stream")]}


class Events:
    """A replica's streamed answer as Ray's handle gives it: the start,
    then ``bodies`` one ``gap_s`` apart, then the end, or, with ``hold``,
    nothing more until cancelled. Counts its cancels."""

    def __init__(self, bodies, gap_s: float = 0.0, hold: bool = False):
        self.queue = [START, *({"type": "http.response.body", "body": b, "more_body": True}
                               for b in bodies)]
        self.gap_s, self.hold, self.cancels, self.asked = gap_s, hold, 0, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.asked += 1
        if self.asked > 1:
            await asyncio.sleep(self.gap_s)
        if self.queue:
            return self.queue.pop(0)
        if self.hold:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self):
        self.cancels += 1


def _scope(spec: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/query",
            "raw_path": b"/v1/query", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2)}


def _relayed(events: Events, ended: list) -> _Relayed:
    """The response the relay builds once the start has come."""
    events.queue.pop(0)
    events.asked = 1
    return _Relayed(events, lambda: ended.append(1), 200)


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
def test_a_stream_sent_whole_ends_its_request_once(spec):
    async def run():
        events, ended, sent = Events([b"data: 1\n\n", b"data: 2\n\n"]), [], []

        async def receive():
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)
        response = _relayed(events, ended)
        await response(_scope(spec), receive, send)
        # before the loop ends: its shutdown would close the events anyway
        return sent, len(ended), events.cancels, response._events.ag_frame is None
    sent, ended, cancels, closed = asyncio.run(run())
    assert [m.get("body") for m in sent[1:] if m.get("body")] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert ended == 1 and cancels >= 1 and closed  # cancelling a complete call is a no-op


def test_a_client_gone_before_the_first_event_ends_its_request():
    """Below ASGI 2.4 the disconnect listener cancels the sending while it is
    still sending the head: the events never started, so their own
    ``finally`` never ran. The call is cancelled and the request uncounted
    anyway, and the replica was never asked for an event."""
    async def run():
        events, ended = Events([b"data: 1\n\n"], gap_s=0.5), []

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0.2)  # the head is slow to go out: the listener wins
        await _relayed(events, ended)(_scope("2.0"), receive, send)
        return len(ended), events.cancels, events.asked
    ended, cancels, asked = asyncio.run(run())
    assert ended == 1 and cancels >= 1
    assert asked == 1  # only the start: no event was waited for


def test_a_send_to_a_client_gone_ends_its_request_at_once():
    """From ASGI 2.4 a gone client shows as a send raising ``OSError``: the
    events are left suspended at that event, and were closed only when
    collected. Now at once, with the call cancelled."""
    async def run():
        events, ended = Events([b"data: 1\n\n", b"data: 2\n\n"], hold=True), []

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                raise OSError("the client is gone")
        response = _relayed(events, ended)
        with pytest.raises(ClientDisconnect):
            await response(_scope("2.4"), receive, send)
        return len(ended), events.cancels, response._events.ag_frame is None
    ended, cancels, closed = asyncio.run(run())
    assert ended == 1 and cancels >= 1 and closed


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
def test_a_stream_cancelled_mid_way_ends_its_request(spec):
    async def run():
        events, ended, sent = Events([b"data: 1\n\n"], hold=True), [], []

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)
        task = asyncio.ensure_future(_relayed(events, ended)(_scope(spec), receive, send))
        while not any(m.get("body") for m in sent):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return len(ended), events.cancels
    ended, cancels = asyncio.run(run())
    assert ended == 1 and cancels >= 1


class _Replicas:
    """Ray's deployment handle as the relay uses it: one ``Events`` a call."""

    def __init__(self, make):
        self.make, self.calls = make, []

    def options(self, **_):
        return self

    @property
    def http(self):
        return self

    def remote(self, scope, body):
        self.calls.append(self.make())
        return self.calls[-1]


def test_a_relay_drains_at_once_when_its_streams_clients_left_before_any_event():
    """The relay counts a request until its answer ends; a stream whose
    client left before its first event stayed counted, and ``drain`` waited
    out its whole grace for it. Now it is uncounted when its sending ends."""
    replicas = _Replicas(lambda: Events([b"data: 1\n\n"], gap_s=0.5))
    relay = Relay(replicas, ServerSettings())

    async def run():
        from starlette.requests import Request

        async def body():
            return {"type": "http.request", "body": b"{}", "more_body": False}
        scope = _scope("2.0")
        response = await relay(Request(scope, body))
        assert isinstance(response, _Relayed) and len(relay.live) == 1

        async def gone():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0.2)
        await response(scope, gone, send)
        counted, cancels = len(relay.live), replicas.calls[0].cancels
        begun = time.monotonic()
        await relay.drain(30.0)
        return counted, cancels, time.monotonic() - begun
    counted, cancels, took = asyncio.run(run())
    assert counted == 0 and cancels >= 1
    assert took < 1.0, took
