"""The Python API against a caller who pushes on its edges: listeners that
ask the process to stop on every event, waits longer than a lock can time,
``submit_many`` handed something that is not a list of calls, cancels at
every moment of a request's life, an async stream read from another
thread's event loop, and submits racing a close.

All run the public ``bubblefree.Engine`` on the simulated GPU
(``tests/serving_world.py``); a ``Gate`` holds the decode thread where a
test must act while a request is certainly live.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from bubblefree import EngineStopped, InvalidRequest, RequestFailed, Status
from tests.serving_world import (GATED, WAIT, Gate, assert_serves, engine, gate, gated,  # noqa: F401 - fixtures
                                 make_engine, wait_idle)


def in_thread(fn):
    """Run ``fn`` in a thread, joined within ``WAIT``: a hang fails, naming
    it, and the thread's exception (or result) comes back here."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(WAIT)
    assert not thread.is_alive(), f"{fn} did not return within {WAIT} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


# -- listeners that stop the engine on every event ---------------------------

@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_listeners_asking_to_stop_on_every_event_still_end_every_request(engine, exc):
    """The first straggler's listener raising at its end left the thread
    with the rest unended: their ``result()`` waited for ever."""
    def stop(handle, token):
        raise exc("stop")

    handles = engine.submit_many([("query", dict(question=f"the cat {w}", max_tokens=5, listener=stop))
                                  for w in ("sits", "is", "on")])
    for handle in handles:
        result = handle.result(WAIT)
        assert result.status is Status.FAILED and exc.__name__ in result.finish_reason
    with pytest.raises(EngineStopped, match=exc.__name__):
        engine.submit("query", question="the cat")


# -- timeouts at the edge of what a lock can wait ---------------------------

@pytest.mark.parametrize("timeout", [1e12, 1e300, 10**400], ids=["1e12", "1e300", "int 10**400"])
def test_a_wait_longer_than_a_lock_can_time_is_no_limit(gated, gate, monkeypatch, timeout):
    """``result(1e12)`` raised ``OverflowError`` from inside the lock's wait
    (an int too large for a float, from ``math.isinf``), where infinity
    already meant no limit. The gate opens from inside ``result``, just
    before its wait: the request ends only once the wait has begun."""
    gate.arm(at=2)
    handle = gated.submit("query", question=GATED, max_tokens=6)
    gate.wait_reached()
    refuse = gated.loop.refuse_wait_on_loop_thread

    def then_open(what):
        refuse(what)
        gate.open()

    monkeypatch.setattr(gated.loop, "refuse_wait_on_loop_thread", then_open)
    assert in_thread(lambda: handle.result(timeout)).status is Status.COMPLETED
    assert handle.output(timeout)["answer"]
    wait_idle(gated)


# -- submit_many handed something that is not calls --------------------------

@pytest.mark.parametrize("calls", [None, 3, object()], ids=["None", "int", "object"])
def test_submit_many_refuses_calls_that_are_not_iterable_naming_them(engine, calls):
    """A bare ``TypeError: 'NoneType' object is not iterable`` named nothing."""
    with pytest.raises(InvalidRequest, match="^calls: must be an iterable of"):
        engine.submit_many(calls)
    assert engine.submit_many([]) == []
    assert_serves(engine)


# -- a cancel at every moment of a request's life ----------------------------

def test_a_request_cancelled_before_its_first_token_ends_cancelled_with_none(gated, gate):
    """Submitted and cancelled while the decode thread is held in another
    request's step: both reach it in one drain, so no token is committed."""
    gate.arm(at=2)
    holder = gated.submit("query", question=GATED, max_tokens=8)
    gate.wait_reached()
    handle = gated.submit("query", question="the cat", max_tokens=8)
    stream = gated.stream("query", question="a dog", max_tokens=8)
    assert handle.cancel() and stream.handle.cancel()
    gate.open()
    result = handle.result(WAIT)
    assert (result.status, result.tokens) == (Status.CANCELLED, ())
    assert not handle.cancel()  # ended: nothing to take
    with pytest.raises(RequestFailed) as err:
        handle.output(0)
    assert err.value.result is result
    with pytest.raises(RequestFailed, match="cancelled"):
        list(stream)
    assert holder.result(WAIT).status is Status.COMPLETED
    wait_idle(gated)
    assert_serves(gated)


def test_a_cancel_after_the_end_changes_nothing(engine):
    handle = engine.submit("query", question="the cat", max_tokens=4)
    result = handle.result(WAIT)
    assert not handle.cancel() and not engine.cancel(handle)
    assert handle.result(0) is result and result.status is Status.COMPLETED
    assert list(handle) == list(result.tokens)  # read after the end: every token, then done
    with pytest.raises(TypeError, match="Handle that submit returned"):
        engine.cancel(handle.request_id)


def test_cancels_from_many_threads_at_once_end_the_request_once(gated, gate):
    """Eight threads cancel one live request together: it ends cancelled,
    its end is told once, and the engine serves on."""
    ends = []
    gate.arm(at=2)
    handle = gated.submit("query", question=GATED, max_tokens=50,
                          listener=lambda h, token: token is None and ends.append(h.request_id))
    gate.wait_reached()
    start = threading.Barrier(8)

    def cancel():
        start.wait(WAIT)
        return handle.cancel()

    threads = [threading.Thread(target=cancel) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    gate.open()
    assert handle.result(WAIT).status is Status.CANCELLED
    wait_idle(gated)
    assert ends == [handle.request_id]
    assert_serves(gated)


# -- an async stream read in another thread's event loop ---------------------

def test_async_pieces_read_in_another_threads_running_loop_give_the_whole_answer(engine):
    """Pieces made in an event loop that keeps running in its own thread
    and read in this one: the tokens go to the loop that made them, so the
    read must come from the handle, whole."""
    answer = engine.run("query", question="the cat", max_tokens=8)["answer"]
    other = asyncio.new_event_loop()
    runner = threading.Thread(target=other.run_forever, daemon=True)
    runner.start()
    try:
        made = asyncio.run_coroutine_threadsafe(
            engine.aquery(question="the cat", stream=True, max_tokens=8), other)
        pieces = made.result(WAIT)["answer"]

        async def read():
            return "".join([piece async for piece in pieces])

        assert asyncio.run(asyncio.wait_for(read(), WAIT)) == answer
    finally:
        other.call_soon_threadsafe(other.stop)
        runner.join(WAIT)
        other.close()
    wait_idle(engine)


# -- submits racing a close -------------------------------------------------

def test_every_request_accepted_while_the_engine_closes_ends(gate):
    """Threads submit, cancel and stream until refused while two others
    close the engine: every accepted request ends, and every later
    submit is refused with ``EngineStopped``."""
    eng = make_engine(gate=gate)
    gate.arm(at=2)
    eng.submit("query", question=GATED, max_tokens=30)
    gate.wait_reached()  # the decode thread is held: the submits below pile up
    accepted, lock = [], threading.Lock()
    refused = threading.Barrier(5)

    def submitter(k):
        while True:
            try:
                handles = eng.submit_many([("query", dict(question=f"the cat {k}", max_tokens=5))] * 2)
            except EngineStopped:
                refused.wait(WAIT)
                return
            handles[k % 2].cancel()
            with lock:
                accepted.extend(handles)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    closers = [threading.Thread(target=eng.close) for _ in range(2)]
    for c in closers:
        c.start()
    gate.open()
    refused.wait(WAIT)
    for t in threads + closers:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads + closers)
    assert accepted
    for handle in accepted:
        assert handle.result(WAIT).status in (Status.COMPLETED, Status.CANCELLED)
    eng.close()  # again: nothing to do
    with pytest.raises(EngineStopped, match="closed"):
        eng.submit("query", question="the cat")
