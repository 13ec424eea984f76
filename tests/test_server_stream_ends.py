"""How a stream ends, as ``EventStream`` tells its ``on_end``: driven here
through its ASGI call with a connection that fails as uvloop's does."""

from __future__ import annotations

import asyncio

import pytest

from bubblefree.server.watch import EventStream


async def _events():
    for i in range(5):
        yield {"i": i}


def _stream(ends: list[str]) -> EventStream:
    return EventStream(_events(), 5.0, lambda err: [{"error": err.status}], ends.append)


async def _never_disconnects():
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


@pytest.mark.parametrize("error", [RuntimeError("unable to perform operation on <TCPTransport closed=True>"),
                                   ConnectionResetError("reset")], ids=["uvloop", "asyncio"])
def test_a_write_to_a_connection_the_client_closed_ends_the_stream_as_client_left(error):
    """Under uvloop a write to a closed transport raises RuntimeError, which
    counted as a bug: the stream ended "error" and the exception reached
    uvicorn, logged as one. It is the client leaving, as asyncio's
    OSError is."""
    ends, written = [], []

    async def send(message):
        if len(written) == 2:
            raise error
        written.append(message)

    asyncio.run(_stream(ends)(scope={"type": "http"}, receive=_never_disconnects, send=send))
    assert ends == ["client_left"] and len(written) == 2


def test_a_stream_read_to_its_end_ends_finished():
    ends, written = [], []

    async def send(message):
        written.append(message)

    asyncio.run(_stream(ends)(scope={"type": "http"}, receive=_never_disconnects, send=send))
    assert ends == ["finished"]
    assert [m.get("body", b"")[:11] for m in written[1:-1]] == [b'data: {"i":'] * 5
    assert written[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
