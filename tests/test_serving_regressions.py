"""One test per serving-layer defect found before the layer was rebuilt, and
per defect found since; each docstring says what used to happen.

All run the public ``bubblefree.Engine`` on the simulated GPU
(``tests/serving_world.py``): requests run to their ``max_tokens``, and a
``Gate`` holds the decode thread where a test must act on a request that is
certainly still running.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import weakref

import pytest

from bubblefree import Engine, EngineStopped, InvalidRequest, RequestFailed, SamplingParams, Status
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import Request
from bubblefree.fake_backend import FakeBackend
from bubblefree.skills.registry import BUILTIN
from tests.serving_world import (GATED, ODD, WAIT, Ends, Gate, OddQuery, Unprintable,  # noqa: F401
                                 assert_serves, engine, gate, gated, idle, make_engine,  # (fixtures)
                                 question_of, reference, wait_idle, wait_until)


def last_end(engine: Engine) -> tuple:
    ends = [e for e in engine.core.trace if e[0] == "end"]
    return ends[-1] if ends else ()


# -- 1. cancel from client threads -------------------------------------------

def test_cancel_from_client_threads_while_steps_launch_never_stops_the_engine(engine):
    """A cancel from a client thread reached into the state machine while the
    decode thread was mid-step: the engine stopped, or answered twice."""
    ends, handles, lock = Ends(), [], threading.Lock()
    submitted = threading.Event()
    cancels = 0

    def submitter(seed):
        rng = random.Random(seed)
        for _ in range(15):
            n = rng.randint(1, 40)
            h = engine.submit("query", question=f"the cat {rng.choice(['sits', 'is', 'on'])}", max_tokens=n,
                              listener=ends.listener())
            with lock:
                handles.append(h)
            if rng.random() < 0.3:
                time.sleep(0)  # jitter only: let a canceller in

    def canceller(seed):
        nonlocal cancels
        rng = random.Random(seed)
        while not submitted.is_set() or rng.random() < 0.9:
            with lock:
                target = rng.choice(handles) if handles else None
            if target is not None and rng.random() < 0.4:
                (engine.cancel if rng.random() < 0.5 else type(target).cancel)(target)
                with lock:
                    cancels += 1
            time.sleep(0)

    subs = [threading.Thread(target=submitter, args=(s,)) for s in range(4)]
    cans = [threading.Thread(target=canceller, args=(100 + s,)) for s in range(3)]
    for t in subs + cans:
        t.start()
    for t in subs:
        t.join(WAIT)
    submitted.set()
    for t in cans:
        t.join(WAIT)
    assert not any(t.is_alive() for t in subs + cans)
    assert cancels > 0 and len(handles) == 60
    ends.wait_all(handles)
    statuses = {h.result(0).status for h in handles}
    assert statuses <= {Status.COMPLETED, Status.CANCELLED}
    for h in handles:
        r = h.result(0)
        if r.status is Status.COMPLETED:  # I8: untouched requests get their own tokens
            assert r.tokens == reference("query", {"question": question_of(h)}, None, h.request.max_tokens)
    wait_idle(engine)
    assert engine.loop.running
    assert_serves(engine)


def test_a_stream_collected_mid_tick_on_the_decode_thread_is_cancelled_between_ticks():
    """A garbage-collected stream's finalizer ran its cancel inside the
    state machine when the collector ran on the decode thread mid-commit:
    the request was ended twice and the engine stopped for everyone."""
    def collect_then_done(state, token):
        if state.consumed >= 3:
            gc.collect()  # what any allocation on the decode thread may trigger
            return True
        return False

    eng = make_engine(registry=BUILTIN.with_skill(OddQuery(name="collects", odd=collect_then_done)))
    try:
        gc.disable()  # so the stream dies in the skill's collection, not earlier
        try:
            stream = eng.stream("collects", question="the cat", max_tokens=20)
            handle = stream.handle
            cycle = [stream]
            cycle.append(cycle)  # only the cyclic collector can free it
            del stream, cycle
            result = handle.result(WAIT)
        finally:
            gc.enable()
        assert result.status in (Status.COMPLETED, Status.CANCELLED)
        assert eng.loop.running, eng.loop._error
        wait_idle(eng)
        assert_serves(eng)
    finally:
        eng.close()


def test_a_cancel_from_a_finalizer_on_a_thread_holding_the_inbox_lock_does_not_deadlock(engine, gate):
    """The inbox lock was not reentrant: a stream finalized by the collector
    on a thread already inside ``submit`` (allocating under the lock) waited
    for itself, and then the decode thread waited for it."""
    stream = engine.stream("query", question="the cat", max_tokens=200)
    handle = stream.handle
    done = threading.Event()

    def finalize_under_the_lock():
        with engine.loop._wake:  # where submit_all allocates Handles
            stream.close()  # the finalizer's own call
        done.set()

    t = threading.Thread(target=finalize_under_the_lock)
    t.start()
    t.join(WAIT)
    assert done.is_set(), "cancel under the inbox lock deadlocked"
    assert handle.result(WAIT).status in (Status.CANCELLED, Status.COMPLETED)
    wait_idle(engine)


# -- 2. listeners that raise --------------------------------------------------

def test_a_raising_listener_fails_only_its_own_request(engine):
    """A listener's exception escaped the tick and stopped the engine."""
    def bad(handle, token):
        if len(handle.tokens) == 3:
            raise ValueError("boom")

    ends = Ends()
    handles = engine.submit_many([("query", dict(question="the cat", max_tokens=20, listener=ends.listener(bad))),
                                  ("query", dict(question="a dog", max_tokens=12, listener=ends.listener())),
                                  ("query", dict(question="red car", max_tokens=9, listener=ends.listener()))])
    ends.wait_all(handles)
    failed = handles[0].result(0)
    assert failed.status is Status.FAILED and failed.finish_reason == "a listener raised ValueError: boom"
    assert len(failed.tokens) == 3
    for h, q, n in ((handles[1], "a dog", 12), (handles[2], "red car", 9)):
        assert h.result(0).status is Status.COMPLETED and h.result(0).tokens == reference("query", {"question": q}, None, n)
    wait_idle(engine)
    assert_serves(engine)


def test_a_listener_raising_on_every_event_does_not_hang_other_callers(engine):
    """A listener that raised on its request's end left the end unrecorded and
    other callers waiting forever."""
    def always(handle, token):
        raise KeyError("always")

    others = [engine.submit("query", question=f"{w} cat", max_tokens=6) for w in ("a", "the")]
    bad = engine.submit("query", question="the dog", max_tokens=30, listener=always)
    assert bad.result(WAIT).status is Status.FAILED and "KeyError" in bad.result(0).finish_reason
    for h, w in zip(others, ("a", "the")):
        assert h.output(WAIT) is not None
        assert h.result(0).tokens == reference("query", {"question": f"{w} cat"}, None, 6)
    wait_until(lambda: any(f"request {bad.request_id}:" in e for e in engine.core.listener_errors),
               "the end listener's raise recorded")
    wait_idle(engine)
    assert_serves(engine)


@pytest.mark.parametrize("where", ["client thread", "listener"])
def test_an_end_listener_raising_inside_a_cancel_does_not_skip_teardown(gated, gate, where):
    """An end listener ran inside the scheduler's cancel; its raise skipped
    the teardown, and the request's pages and row slot never came back."""
    def raise_at_end(handle, token):
        if token is None:
            raise RuntimeError("end")
        if where == "listener" and len(handle.tokens) == 1:
            handle.cancel()

    if where == "client thread":
        gate.arm(at=3)
    handle = gated.submit("query", question=GATED, max_tokens=100, listener=raise_at_end)
    if where == "client thread":
        gate.wait_reached()
        assert handle.cancel()
        gate.open()
    assert handle.result(WAIT).status is Status.CANCELLED
    wait_idle(gated)
    wait_until(lambda: any("RuntimeError: end" in e for e in gated.core.listener_errors), "raise recorded")
    assert_serves(gated)


# -- 3. asyncio and abandoned streams ---------------------------------------

def cancel_task_mid_request(engine, gate, coroutine) -> None:
    """Run ``coroutine`` as a task, cancel it while the decode thread is held
    inside the request's step, and check the request ended cancelled."""
    async def main():
        gate.arm(at=2)
        task = asyncio.ensure_future(coroutine())
        await asyncio.get_running_loop().run_in_executor(None, gate.wait_reached)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()

    asyncio.run(main())
    wait_idle(engine)
    assert last_end(engine)[2] == "cancelled"


def test_cancelling_the_task_awaiting_arun_cancels_the_request(gated, gate):
    """The request went on decoding after its awaiting task was cancelled."""
    cancel_task_mid_request(gated, gate, lambda: gated.arun("query", question=GATED, max_tokens=150))
    assert_serves(gated)


def test_closing_an_astream_early_cancels_the_request(gated, gate):
    """Closing the async generator left its request decoding: the inner
    generator, and its cancel, waited for the garbage collector."""
    async def main():
        gate.arm(at=3)
        stream = gated.astream("query", question=GATED, max_tokens=150)
        first = await stream.__anext__()
        gate.wait_reached()  # the decode thread is held: the request is live
        await stream.aclose()
        gate.open()
        return first

    assert asyncio.run(main())
    wait_idle(gated)
    assert last_end(gated)[2] == "cancelled"
    assert_serves(gated)


def test_cancelling_the_task_iterating_astream_cancels_the_request(gated, gate):
    """The request went on decoding after the task reading its stream was cancelled."""
    async def read():
        return [p async for p in gated.astream("query", question=GATED, max_tokens=150)]

    cancel_task_mid_request(gated, gate, read)


# The orphaned task's own asyncio.Queue complains, when it is collected, that
# its loop is closed: asyncio's noise about the caller's abandoned coroutine.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("call", ["arun", "astream"])
def test_an_event_loop_closed_mid_request_does_not_stop_the_engine(gated, gate, call):
    """Delivering to a closed event loop raised on the decode thread and
    stopped the engine for every caller."""
    async def consume():
        if call == "arun":
            return await gated.arun("query", question=GATED, max_tokens=150)
        return [p async for p in gated.astream("query", question=GATED, max_tokens=150)]

    gate.arm(at=2)
    loop = asyncio.new_event_loop()
    task = loop.create_task(consume())
    loop.run_until_complete(loop.run_in_executor(None, gate.wait_reached))
    loop.close()  # the task never finishes: its loop is gone
    gate.open()
    wait_until(lambda: last_end(gated), "the orphaned request ended")
    assert last_end(gated)[2] == "cancelled"
    del task
    gc.collect()
    assert gated.loop.running
    wait_idle(gated)
    assert_serves(gated)


@pytest.mark.parametrize("read", [0, 1])
def test_an_abandoned_stream_is_cancelled_when_collected(gated, gate, read):
    """A stream dropped unread (or half read) kept decoding to its max_tokens."""
    gate.arm(at=2)
    stream = gated.stream("query", question=GATED, max_tokens=150)
    handle = stream.handle
    for _ in range(read):
        assert next(stream)
    gate.wait_reached()
    del stream
    gc.collect()
    gate.open()
    assert handle.result(WAIT).status is Status.CANCELLED
    wait_idle(gated)


def test_arun_astream_and_stream_answer_as_run_does_and_call_the_callers_listener(engine):
    """The asyncio calls' answers on requests that complete (every test above
    cancels them): arun's output is run's, astream's and stream's pieces (the
    skill defaults to query) join to its text, and a ``listener=`` given to an
    asyncio call still sees every token, then the end."""
    question, n = "the cat", 6
    tokens = reference("query", {"question": question}, None, n)
    answer = engine.run("query", question=question, max_tokens=n)
    seen: dict[str, list] = {"arun": [], "astream": []}

    async def main():
        out = await engine.arun("query", question=question, max_tokens=n,
                                listener=lambda h, t: seen["arun"].append(t))
        pieces = [p async for p in engine.astream(question=question, max_tokens=n,
                                                   listener=lambda h, t: seen["astream"].append(t))]
        return out, pieces

    out, pieces = asyncio.run(main())
    assert out == answer
    assert "".join(pieces) == "".join(engine.stream(question=question, max_tokens=n)) == answer["answer"]
    assert seen == {"arun": [*tokens, None], "astream": [*tokens, None]}
    wait_idle(engine)


def test_cancelling_the_task_awaiting_arun_cancels_the_request_while_its_loop_runs(gated, gate):
    """With the event loop still running (a server's), nothing but arun's own
    cleanup cancels the request: a closed loop would (the tests above end
    theirs with the task)."""
    async def main():
        gate.arm(at=2)
        task = asyncio.ensure_future(gated.arun("query", question=GATED, max_tokens=150))
        await asyncio.get_running_loop().run_in_executor(None, gate.wait_reached)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.open()
        await asyncio.get_running_loop().run_in_executor(
            None, wait_until, lambda: last_end(gated), "the request ended")
        return last_end(gated)[2]

    assert asyncio.run(main()) == "cancelled"
    wait_idle(gated)


def test_output_waits_only_its_timeout_and_names_the_cut_result(gated, gate):
    """``output(timeout)`` on a live request raises TimeoutError after the
    timeout; on a cancelled one, RequestFailed carries the Result."""
    gate.arm(at=2)
    handle = gated.submit("query", question=GATED, max_tokens=150)
    gate.wait_reached()
    with pytest.raises(TimeoutError):
        handle.output(0.01)
    handle.cancel()
    gate.open()
    with pytest.raises(RequestFailed) as err:
        handle.output(WAIT)
    assert err.value.result is handle.result(0)
    assert err.value.result.status is Status.CANCELLED
    wait_idle(gated)


# -- 4. sampling values -------------------------------------------------------

@pytest.mark.parametrize("sampling,field", [
    ({"temperature": float("inf")}, "sampling.temperature"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"temperature": True}, "sampling.temperature"),
    ({"temperature": "hot"}, "sampling.temperature"),
    ({"temperature": 1e300}, "sampling.temperature"),
    ({"seed": 1.5}, "sampling.seed"),
    ({"seed": "7"}, "sampling.seed"),  # None is no seed: a fresh one (SamplingParams)
    ({"seed": True}, "sampling.seed"),
    ({"seed": -1}, "sampling.seed"),
    ({"top_p": 0}, "sampling.top_p"),
    ({"temp": 0.5}, "sampling: unknown field(s) temp"),
    ("greedy", "sampling"),
    (0.7, "sampling"),
])
def test_bad_sampling_values_are_refused_naming_the_field(engine, sampling, field):
    """Bad sampling values reached the device: inf/NaN sampled outside the
    mask, a str or float seed raised TypeError deep in a step."""
    with pytest.raises(InvalidRequest) as err:
        engine.submit("query", question="the cat", sampling=sampling, max_tokens=3)
    assert str(err.value).startswith(field), err.value
    assert_serves(engine)


def test_sampling_as_a_dict_with_good_keys_is_accepted(engine):
    """A dict of sampling fields was refused or ignored."""
    handle = engine.submit("query", question="the cat", sampling={"temperature": 0.8, "top_p": 0.9, "seed": 7},
                           max_tokens=6)
    assert handle.request.sampling == SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    assert handle.result(WAIT).tokens == reference("query", {"question": "the cat"}, SamplingParams(0.8, 0.9, 7), 6)


def test_an_int_temperature_samples_alone_as_batched_with_a_float_row(engine):
    """An int temperature made a batch tensor of the wrong type: its row
    sampled differently alone and next to a float row."""
    alone = engine.submit("query", question="the cat", sampling={"temperature": 1, "seed": 3}, max_tokens=12)
    alone_tokens = alone.result(WAIT).tokens
    assert type(alone.request.sampling.temperature) is float
    pair = engine.submit_many([("query", dict(question="the cat", sampling={"temperature": 1, "seed": 3},
                                              max_tokens=12)),
                               ("query", dict(question="a dog", sampling={"temperature": 0.7, "seed": 3},
                                              max_tokens=12))])
    assert pair[0].result(WAIT).tokens == alone_tokens
    assert alone_tokens == reference("query", {"question": "the cat"}, SamplingParams(1.0, seed=3), 12)


@pytest.mark.parametrize("call,field", [
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=0), "max_tokens"), (dict(max_tokens="3"), "max_tokens"),
    (dict(question="\ud800"), "question"), (dict(listener=3), "listener"), (dict(colour="red"), "colour"),
])
def test_bad_request_values_are_refused_at_submit(engine, call, field):
    """Bad values raised TypeError or UnicodeEncodeError, or failed later on the decode thread."""
    args = dict(question="the cat", max_tokens=4)
    args.update(call)
    with pytest.raises(InvalidRequest) as err:
        engine.submit("query", **args)
    assert str(err.value).startswith(field), err.value
    with pytest.raises(InvalidRequest, match="^skill"):
        engine.submit("no such skill", question="x")
    assert_serves(engine)


# -- 5. skills with a bad mask ------------------------------------------------

@pytest.mark.parametrize("skill", ["unregistered_mask", "str_mask", "bool_mask"])
def test_a_skill_with_a_bad_mask_id_fails_only_its_own_request(skill):
    """An unregistered mask id failed every row of the step; a non-int one
    stopped the engine."""
    eng = make_engine(registry=ODD)
    try:
        handles = eng.submit_many([("query", dict(question="the cat", max_tokens=8)),
                                   (skill, dict(question="the cat", max_tokens=8)),
                                   ("query", dict(question="a dog", max_tokens=8))])
        bad = handles[1].result(WAIT)
        assert bad.status is Status.FAILED and f"skill {skill!r}: mask_id() returned" in bad.finish_reason
        for h, q in ((handles[0], "the cat"), (handles[2], "a dog")):
            assert h.result(WAIT).tokens == reference("query", {"question": q}, None, 8)
        wait_idle(eng)
        assert_serves(eng)
    finally:
        eng.close()


# -- 6. streams end in RequestFailed when the request did not complete ------

def test_a_stream_cancelled_by_someone_else_raises_request_failed(gated, gate):
    """A stream whose request another caller cancelled ended quietly, its cut
    answer passing for a whole one."""
    gate.arm(at=3)
    stream = gated.stream("query", question=GATED, max_tokens=150)
    assert next(stream)
    gate.wait_reached()
    assert stream.handle.cancel()
    gate.open()
    with pytest.raises(RequestFailed, match="cancelled"):
        list(stream)


def test_a_stream_whose_request_failed_raises_request_failed():
    """A failed request's stream ended quietly."""
    eng = make_engine(registry=ODD)
    try:
        with pytest.raises(RequestFailed, match="ZeroDivisionError"):
            list(eng.stream("raising_skill", question="the cat", max_tokens=10))

        async def read(**args):
            return [p async for p in eng.astream(**args)]

        with pytest.raises(RequestFailed, match="ZeroDivisionError"):
            asyncio.run(read(skill="raising_skill", question="the cat", max_tokens=10))
    finally:
        eng.close()


def test_an_astream_cancelled_by_someone_else_raises_request_failed(gated, gate):
    """An async stream whose request another caller cancelled ended quietly;
    it also refused a ``listener`` with a TypeError."""
    seen = []

    async def read():
        return [p async for p in gated.astream("query", question=GATED, max_tokens=150,
                                               listener=lambda h, t: seen.append(h))]

    gate.arm(at=3)
    canceller = threading.Thread(target=lambda: (gate.wait_reached(), seen[0].cancel(), gate.open()))
    canceller.start()
    with pytest.raises(RequestFailed, match="cancelled"):
        asyncio.run(read())
    canceller.join(WAIT)
    assert not canceller.is_alive()


# -- 7. errors that said the wrong thing -------------------------------------

def test_a_skills_own_exception_is_named_in_the_reason():
    """A skill's bug was reported as a generic failure, its type and message lost."""
    eng = make_engine(registry=ODD)
    try:
        result = eng.submit("raising_skill", question="the cat", max_tokens=10).result(WAIT)
        assert result.status is Status.FAILED
        assert "skill 'raising_skill'" in result.finish_reason
        assert "ZeroDivisionError" in result.finish_reason and "no room left in the answer" in result.finish_reason
    finally:
        eng.close()


def test_max_objects_that_cannot_fit_is_named():
    """Too many objects for the context was blamed on max_tokens, which the caller never gave."""
    eng = make_engine(max_context=64)
    try:
        with pytest.raises(InvalidRequest, match="^max_objects"):
            eng.detect("the cat", max_objects=50)
    finally:
        eng.close()


def test_a_default_max_tokens_beyond_a_small_context_is_cut_not_refused():
    """A request without max_tokens was refused on a small model: its default exceeded the context."""
    eng = make_engine(max_context=40)
    try:
        handle = eng.submit("query", question="the cat")
        room = 40 - len(handle.request.prompt)
        assert handle.request.max_tokens == room
        assert len(handle.result(WAIT).tokens) == room
    finally:
        eng.close()


def test_the_core_refuses_a_bool_max_tokens_and_a_str_sampling():
    """The core took max_tokens=True as 1 and sampling="greedy" until a step crashed on it."""
    core = CoreEngine(FakeBackend(zero_cost=True))
    with pytest.raises(InvalidRequest, match="^max_tokens"):
        core.submit(Request(prompt=(1, 2), max_tokens=True))
    with pytest.raises(InvalidRequest, match="^sampling"):
        core.submit(Request(prompt=(1, 2), max_tokens=3, sampling="greedy"))
    assert not core.handles and not core.has_work()


# -- 8. lifecycle --------------------------------------------------------------

def test_an_engine_dropped_without_close_ends_its_thread_and_frees_the_core():
    """A dropped Engine's decode thread ran forever, holding the model and the KV cache."""
    eng = make_engine()
    assert_serves(eng)
    core, thread = weakref.ref(eng.core), eng.loop._thread
    del eng
    gc.collect()
    thread.join(WAIT)
    assert not thread.is_alive()
    gc.collect()
    assert core() is None


def test_close_from_a_listener_ends_the_engine_cleanly(engine):
    """close() from a listener joined the decode thread from itself, or
    stopped it mid-delivery, leaving requests unanswered."""
    ends = Ends()

    def closer(handle, token):
        if len(handle.tokens) == 2 and token is not None:
            engine.close()

    handles = engine.submit_many([("query", dict(question="the cat", max_tokens=50, listener=ends.listener(closer))),
                                  ("query", dict(question="a dog", max_tokens=50, listener=ends.listener())),
                                  ("query", dict(question="red car", max_tokens=1, listener=ends.listener()))])
    ends.wait_all(handles)
    engine.loop._thread.join(WAIT)
    assert not engine.loop._thread.is_alive()
    assert handles[0].result(0).status is Status.CANCELLED
    assert handles[2].result(0).status is Status.COMPLETED
    assert idle(engine)
    with pytest.raises(EngineStopped, match="closed"):
        engine.submit("query", question="the cat")


@pytest.mark.parametrize("blocking", ["query", "result", "stream", "iterate"])
def test_a_blocking_call_from_a_listener_raises_instead_of_deadlocking(engine, blocking):
    """A listener that waited for a result waited for its own thread: the engine hung."""
    def listener(handle, token):
        if token is None or len(handle.tokens) != 2:
            return
        if blocking == "query":
            engine.query("the cat", max_tokens=2)
        elif blocking == "result":
            handle.result()
        elif blocking == "stream":
            list(engine.stream("query", question="the cat", max_tokens=2))
        else:
            list(handle)

    handle = engine.submit("query", question="a dog", max_tokens=30, listener=listener)
    result = handle.result(WAIT)
    assert result.status is Status.FAILED
    assert result.finish_reason.startswith("a listener raised RuntimeError") and "decode thread" in result.finish_reason
    wait_idle(engine)
    assert_serves(engine)


# -- 9. concurrent requests batch ---------------------------------------------

def test_concurrent_submits_return_while_a_step_runs_and_share_decode_steps(gated, gate):
    """A lock held across each step made a submit wait for it, and requests
    from different threads never shared a step."""
    gate.arm(at=2)
    first = gated.submit("query", question=GATED, max_tokens=20)
    gate.wait_reached()  # the decode thread is inside a step now
    before = len(gated.core.trace)
    start = threading.Barrier(7)
    handles = []

    def ask(k):
        start.wait(WAIT)
        handles.append(gated.submit("query", question=f"the cat w{k}", max_tokens=16))

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(handles) == 7, "a submit waited for the step to finish"
    gate.open()
    assert first.result(WAIT).status is Status.COMPLETED
    for h in handles:
        assert h.result(WAIT).tokens == reference("query", {"question": question_of(h)}, None, 16)
    launches = [e for e in gated.core.trace[before:] if e[0] == "launch" and e[2] == "decode"]
    assert max(len(e[4]) for e in launches) == 8  # all eight live requests in one step


def test_submit_many_shares_one_prefill_and_the_decode_steps(engine):
    """Requests handed over together were prefilled one by one."""
    calls = [("query", dict(question=f"the cat {w}", max_tokens=10)) for w in ("sits", "is", "on", "red")]
    handles = engine.submit_many(calls)
    for h in handles:
        h.result(WAIT)
    ids = tuple(h.request_id for h in handles)
    launches = [e for e in engine.core.trace if e[0] == "launch" and set(e[4]) & set(ids)]
    assert launches[0][2] == "prefill" and launches[0][4] == ids
    assert all(e[4] == ids for e in launches if e[2] == "decode")


# -- 10. found by the state machine -------------------------------------------

@pytest.mark.parametrize("skill,args", [("detect", {"object": "a dog"}), ("point", {"object": "the cat"})])
def test_switching_to_blocking_with_a_step_in_flight_keeps_masks_current(engine, skill, args):
    """The first blocking tick after a switch finalized a new step before the
    pipelined step in flight had committed: its mask missed a token (I9),
    and a constrained request failed on a token its own skill refused."""
    def switch(handle, token):
        if token is not None and len(handle.tokens) == 2:
            engine.pipelined = False  # from a listener: made at once, a step in flight

    handle = engine.submit(skill, max_tokens=20, listener=switch, **args)
    result = handle.result(WAIT)
    assert not engine.pipelined
    assert result.status is Status.COMPLETED, result.finish_reason
    assert result.tokens == reference(skill, args, None, 20)
    wait_idle(engine)


# -- 11. found by an audit of the public API ----------------------------------

@pytest.mark.parametrize("bad", [float("nan"), "1", -1.0, True, [1]])
def test_a_waits_timeout_is_seconds_or_none_named_when_it_is_not(engine, bad):
    """``result(nan)`` never timed out and spun on the handle's lock (a
    0.3 s request took 25 s, starving the decode thread); ``result("1")``
    raised a bare TypeError from inside the lock."""
    handle = engine.submit("query", question="the cat", max_tokens=3)
    with pytest.raises(ValueError, match="timeout: seconds >= 0 or None"):
        handle.result(bad)
    with pytest.raises(ValueError, match="timeout"):
        handle.output(bad)
    assert handle.result(float("inf")).status is Status.COMPLETED  # no limit
    wait_idle(engine)


def test_the_asyncio_calls_refuse_an_async_listener_too(engine):
    """``submit`` refused an ``async def`` listener, but the asyncio calls
    wrapped it in their own first: it was accepted and its body never ran."""
    async def listener(handle, token):
        pass

    async def main():
        for call in (engine.aquery(question="the cat", max_tokens=3, listener=listener),
                     engine.arun("query", question="the cat", max_tokens=3, listener=listener),
                     engine.astream_now("query", question="the cat", max_tokens=3,
                                        listener=listener)):
            with pytest.raises(InvalidRequest, match="listener: must be a plain function"):
                await call

    asyncio.run(main())
    assert_serves(engine)


@pytest.mark.parametrize("field", ["max_context", "max_positions", "name"])
def test_the_engines_own_keywords_are_refused_as_unknown_arguments(engine, field):
    """``query("hi", max_context=5)`` raised a bare TypeError ("got multiple
    values for keyword argument"), as did ``name=``."""
    with pytest.raises(InvalidRequest, match=f"^{field}: unknown argument"):
        engine.submit("query", question="the cat", **{field: 5})
    with pytest.raises(InvalidRequest, match=r"calls\[0\]: argument names must be strings"):
        engine.submit_many([("query", {1: 2})])
    assert_serves(engine)


class UnprintableExit(SystemExit):
    __str__ = Unprintable.__str__


def test_a_listener_error_whose_message_raises_fails_only_its_request(engine):
    """Writing the reason raised again: the engine stopped, every request
    failing, where only the listener's request should."""
    def listener(handle, token):
        if token is not None:
            raise Unprintable()

    mine, other = engine.submit_many([("query", dict(question="the cat", max_tokens=5,
                                                      listener=listener)),
                                       ("query", dict(question="a dog", max_tokens=5))])
    assert mine.result(WAIT).status is Status.FAILED
    assert "Unprintable: (its message raised RuntimeError)" in mine.result(0).finish_reason
    assert other.result(WAIT).status is Status.COMPLETED
    assert_serves(engine)


def test_a_stop_whose_reason_cannot_be_written_still_ends_every_request():
    """A listener's SystemExit stops the engine; with a message that raised,
    writing the stop's reason killed the decode thread before it ended any
    handle: every ``result()`` waited for ever."""
    eng = make_engine()

    def listener(handle, token):
        if token is not None:
            raise UnprintableExit()

    try:
        handles = eng.submit_many([("query", dict(question="the cat", max_tokens=5,
                                                   listener=listener)),
                                   ("query", dict(question="a dog", max_tokens=50))])
        for handle in handles:
            result = handle.result(WAIT)
            assert result.status is Status.FAILED
            assert "UnprintableExit: (its message raised RuntimeError)" in result.finish_reason
        with pytest.raises(EngineStopped):
            eng.submit("query", question="the cat", max_tokens=3)
    finally:
        eng.close()


def test_async_pieces_read_in_another_event_loop_end_at_once(gated, gate):
    """Pieces made in one ``asyncio.run`` and read in the next: the request
    was cancelled when the first loop was gone, but the read waited for ever
    for tokens that could no longer reach it."""
    gate.arm(at=2)

    async def make():
        pieces = (await gated.aquery(question=GATED, stream=True, max_tokens=30))["answer"]
        await asyncio.get_running_loop().run_in_executor(None, gate.wait_reached)
        return pieces

    pieces = asyncio.run(make())
    gate.open()  # the next token finds the stream's loop closed: the request is cancelled

    async def read():
        return [piece async for piece in pieces]

    with pytest.raises(RequestFailed) as err:
        asyncio.run(asyncio.wait_for(read(), WAIT))
    assert err.value.result.status is Status.CANCELLED
    wait_idle(gated)


def test_async_pieces_read_on_after_a_timed_out_read_end_in_request_failed(gated, gate):
    """A read cancelled by ``wait_for``'s timeout cancelled the request, and
    reading on then ended as if complete: two pieces of thirty passed for
    the whole answer."""
    gate.arm(at=2)

    async def main():
        pieces = (await gated.aquery(question=GATED, stream=True, max_tokens=30))["answer"]
        got = []
        with pytest.raises(asyncio.TimeoutError):
            while True:
                got.append(await asyncio.wait_for(pieces.__anext__(), 0.2))
        gate.open()
        with pytest.raises(RequestFailed) as err:
            async for piece in pieces:
                got.append(piece)
        return err.value.result

    result = asyncio.run(main())
    assert result.status is Status.CANCELLED and len(result.tokens) < 30
    wait_idle(gated)


class Interrupted(Exception):
    pass


def test_a_blocking_stream_read_on_after_an_interrupted_read_ends_in_request_failed(gated, gate):
    """A signal (Ctrl-C) while a stream waited cancelled the request, and
    reading on then ended quietly: the cut answer passed for a whole one.
    Here a timer's signal interrupts the wait at the gate."""
    import signal

    def interrupt(signum, frame):
        raise Interrupted

    gate.arm(at=2)
    stream = gated.stream("query", question=GATED, max_tokens=30)
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Interrupted):
            while True:
                next(stream)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    gate.open()
    with pytest.raises(RequestFailed) as err:
        list(stream)
    assert err.value.result.status is Status.CANCELLED and len(err.value.result.tokens) < 30
    wait_idle(gated)
