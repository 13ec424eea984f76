"""One stream, two readers at once: the second is refused, the first's
answer is whole.

A second task (thread) reading a stream while another is inside a read got
the iterator's "already running" error, and the stream took that error for
its reader's own: it cancelled the request, so the first reader's answer was
cut off. The decode thread is held at a ``Gate`` while the second reader
tries, so the first is certainly inside its read then (a condition, not a
timing).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from bubblefree.core import Status
from bubblefree.handle import RequestFailed
from tests.serving_world import WAIT, assert_serves, gate, gated, wait_until  # noqa: F401 (fixtures)

QUESTION = "why is the sky blue"  # "sky": the gate holds this request
MAX_TOKENS = 24
TWICE = "already being read by another"


def sole_text(engine) -> str:
    """What a stream's only reader gets."""
    return "".join(engine.stream("query", question=QUESTION, max_tokens=MAX_TOKENS))


async def read_all(pieces) -> str:
    return "".join([piece async for piece in pieces])


async def second_read(pieces) -> BaseException | None:
    """What the second reader's read raised: kept, to be checked after the
    first reader's answer, the harm that matters most."""
    try:
        await pieces.__anext__()
    except Exception as err:
        return err
    return None


def refused(err: BaseException | None, reader: str) -> None:
    assert isinstance(err, RuntimeError) and f"{TWICE} {reader}" in str(err), repr(err)


async def astream_now(engine):
    return await engine.astream_now("query", question=QUESTION, max_tokens=MAX_TOKENS)


async def aquery_stream(engine):
    return (await engine.aquery(QUESTION, stream=True, max_tokens=MAX_TOKENS))["answer"]


@pytest.mark.parametrize("opened", [astream_now, aquery_stream])
def test_a_second_task_reading_an_async_stream_is_refused_and_the_first_gets_its_whole_answer(
        gated, gate, opened):
    sole = sole_text(gated)

    async def main():
        gate.arm()
        pieces = await opened(gated)
        first = asyncio.create_task(read_all(pieces))
        # Once the decode thread is held, the first task has started and can
        # only be waiting inside a read: the request cannot end while held.
        await asyncio.to_thread(gate.wait_reached)
        second = await second_read(pieces)
        gate.open()
        return pieces.handle, await first, second

    handle, text, second = asyncio.run(main())
    assert text == sole
    assert handle.result(0).status is Status.COMPLETED
    refused(second, "task")
    assert_serves(gated)


def test_a_second_task_reading_astream_leaves_the_first_whole(gated, gate):
    """``astream`` is an async generator: Python refuses its second reader
    itself, and the first must still get its whole answer."""
    sole = sole_text(gated)

    async def main():
        gate.arm()
        pieces = gated.astream("query", question=QUESTION, max_tokens=MAX_TOKENS)
        first = asyncio.create_task(read_all(pieces))
        await asyncio.to_thread(gate.wait_reached)
        second = await second_read(pieces)
        gate.open()
        return await first, second

    text, second = asyncio.run(main())
    assert text == sole
    assert isinstance(second, RuntimeError) and "already running" in str(second), repr(second)
    assert_serves(gated)


def test_a_second_thread_reading_a_stream_is_refused_and_the_first_gets_its_whole_answer(gated, gate):
    sole = sole_text(gated)
    gate.arm()
    pieces = gated.stream("query", question=QUESTION, max_tokens=MAX_TOKENS)
    got: list = []
    first = threading.Thread(target=lambda: got.append("".join(pieces)))
    first.start()
    gate.wait_reached()
    # Held, the first thread ends up waiting on the handle for a token: inside a read.
    wait_until(lambda: pieces.handle._iterators == 1, "the first reader waiting for a token")
    try:
        next(pieces)
        second = None
    except Exception as err:
        second = err
    gate.open()
    first.join(WAIT)
    assert got == [sole]
    assert pieces.handle.result(0).status is Status.COMPLETED
    refused(second, "thread")
    assert_serves(gated)


@pytest.mark.parametrize("opened", [astream_now, aquery_stream])
def test_another_task_closing_a_stream_being_read_cancels_it_and_raises_nothing(gated, gate, opened):
    """A watchdog closing the stream a task is reading: the close itself
    got the generator's "already running" error. Now it cancels the
    request, the reader's read ends with ``RequestFailed``, and the engine
    serves on."""
    async def main():
        gate.arm()
        pieces = await opened(gated)
        first = asyncio.create_task(read_all(pieces))
        await asyncio.to_thread(gate.wait_reached)
        closed = None
        try:
            await pieces.aclose()
        except Exception as err:
            closed = err
        gate.open()
        try:
            await first
            read = None
        except Exception as err:
            read = err
        return pieces, closed, read

    pieces, closed, read = asyncio.run(main())
    assert closed is None, repr(closed)
    assert isinstance(read, RequestFailed), repr(read)
    assert pieces.handle.result(WAIT).status is Status.CANCELLED
    assert_serves(gated)
