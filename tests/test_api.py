"""The user-facing API on the embedded model, on whatever device is here:
blocking, streaming and asyncio calls, concurrency, every skill's result
shape, bad input, and the pipelined/blocking switch."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bubblefree import Engine, InvalidRequest
from bubblefree.core import Status


@pytest.fixture(scope="module")
def engine():
    eng = Engine.from_pretrained(location_tokens=True, max_rows=8, max_seqs=16, num_pages=512,
                                 max_prefill_tokens=512, max_context=1024)
    yield eng
    eng.close()


def test_query_answers_a_real_question(engine):
    answer = engine.query("What is the capital of France?", max_tokens=24)["answer"]
    assert "Paris" in answer


def test_stream_yields_the_same_text_as_the_blocking_call(engine):
    question = "Name a primary colour."
    pieces = list(engine.stream_query(question, max_tokens=16))
    assert len(pieces) > 1
    blocking = engine.query(question, max_tokens=16)["answer"]
    assert "".join(pieces).strip() == blocking


def test_asyncio_calls_run_concurrently_and_agree(engine):
    questions = ["What is 2 plus 2?", "What colour is the sky?", "Name a fruit."]

    async def ask_all():
        return await asyncio.gather(*(engine.aquery(q, max_tokens=12) for q in questions))

    got = asyncio.run(ask_all())
    assert got == [engine.query(q, max_tokens=12) for q in questions]


def test_async_stream(engine):
    async def collect():
        return [p async for p in engine.astream("query", question="Say hello.", max_tokens=8)]

    assert "".join(asyncio.run(collect())).strip() == engine.query("Say hello.", max_tokens=8)["answer"]


def test_threads_batch_together_and_each_gets_its_own_answer(engine):
    questions = [f"What is {i} plus {i}?" for i in range(6)]
    alone = {q: engine.query(q, max_tokens=10) for q in questions}
    results: dict[str, dict] = {}
    before = len(engine.core.trace)

    def ask(q):
        results[q] = engine.query(q, max_tokens=10)

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone  # I8: batch composition does not change a request's tokens
    launches = [e for e in engine.core.trace[before:] if e[0] == "launch" and e[2] == "decode"]
    assert max(len(e[4]) for e in launches) > 1, "concurrent requests never shared a step"


def test_every_skill_returns_its_result_shape(engine):
    caption = engine.caption("short", max_tokens=12)
    assert isinstance(caption["caption"], str)
    points = engine.point("the cat", max_tokens=12)["points"]
    assert all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
    for box in engine.detect("the cat", max_tokens=16)["objects"]:
        assert 0 <= box["x_min"] <= box["x_max"] <= 1 and 0 <= box["y_min"] <= box["y_max"] <= 1
    seg = engine.segment("the cat", max_tokens=24)
    assert set(seg) == {"path", "bbox"} and isinstance(seg["path"], str)


@pytest.mark.parametrize("call,field", [
    (lambda e: e.run("nope", question="x"), "skill"),
    (lambda e: e.point(""), "object"),
    (lambda e: e.detect("cat", max_objects=0), "max_objects"),
    (lambda e: e.caption("huge"), "length"),
    (lambda e: e.query("word " * 2000), "prompt"),
])
def test_bad_input_names_the_field_and_the_engine_keeps_serving(engine, call, field):
    with pytest.raises(InvalidRequest) as err:
        call(engine)
    assert str(err.value).startswith(field), err.value
    assert "Paris" in engine.query("What is the capital of France?", max_tokens=24)["answer"]


def test_cancel_in_flight_ends_as_cancelled(engine):
    """Cancelled from its own token listener (on the decode thread, between
    ticks), so the request cannot finish first, however fast the machine."""
    done = threading.Event()

    def listener(handle, token):
        if token is None:
            done.set()
        elif len(handle.tokens) == 3:
            assert handle.cancel()

    handle = engine.submit("query", question="Tell me a long story.", max_tokens=200,
                           listener=listener)
    assert done.wait(120)
    assert handle.result(0).status is Status.CANCELLED and len(handle.result(0).tokens) == 3
    assert "Paris" in engine.query("What is the capital of France?", max_tokens=24)["answer"]


def test_blocking_mode_is_one_flag_away_and_agrees(engine):
    question = "Which planet is closest to the sun?"
    piped = engine.query(question, max_tokens=20)
    before = engine.pipelined
    assert before == "auto"  # the default
    try:
        for mode in (False, True):
            engine.pipelined = mode
            assert engine.pipelined is mode
            assert engine.query(question, max_tokens=20) == piped  # I8
    finally:
        engine.pipelined = before
