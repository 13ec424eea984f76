"""The Python API across an engine's life and a request's edges: an engine
used in a child of ``fork()``, listeners that are async without being an
``async def``, sampling numbers of other types or past a float's range, a
stream read from a listener, a copied ``Handle``, a ``close`` held up by a
listener, and a process that exits with an engine nobody closed. Each was a
hang, a silent loss, a bare error or a crash before."""

from __future__ import annotations

import copy
import fractions
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

from bubblefree import Engine, EngineStopped, InvalidRequest, Status
from bubblefree.core import SamplingParams
from tests.serving_world import (GATED, WAIT, assert_serves, engine, gate, gated,  # noqa: F401 - fixtures
                                 make_engine, wait_idle)

# -- an engine used in a child of fork() -------------------------------------

# The child's outcomes, as its exit code says them.
REFUSED, ACCEPTED, OTHER_ERROR = 0, 1, 2


def _in_child(engine, act) -> int:
    """What ``act(engine)`` does in a child of fork(): the exit code, read by
    the parent within ``WAIT`` (a child that hangs is killed, and fails)."""
    with warnings.catch_warnings():  # 3.12 warns of fork() in a threaded process: that is the case here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of pytest's
        code = OTHER_ERROR
        try:
            act(engine)
            code = ACCEPTED
        except EngineStopped as err:
            code = REFUSED if "a child of fork() must build its own" in str(err) else OTHER_ERROR
        except BaseException:  # noqa: BLE001 - told to the parent by the code
            pass
        os._exit(code)
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the child of fork() still waited after {WAIT} s")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
@pytest.mark.parametrize("act", [
    lambda eng: eng.submit("query", question="is there a cat", max_tokens=3).result(WAIT),
    lambda eng: eng.query("is there a cat", max_tokens=3),
    lambda eng: setattr(eng, "pipelined", False),
], ids=["submit", "query", "set-pipelined"])
def test_an_engine_used_in_a_child_of_fork_refuses_naming_why(engine, act):
    """fork() copies the engine but not its decode thread: the child's work
    was accepted and waited for ever. Now it is refused at once, saying the
    child must build its own; the parent's engine serves on."""
    assert_serves(engine)
    assert _in_child(engine, act) == REFUSED
    assert_serves(engine)
    wait_idle(engine)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
@pytest.mark.parametrize("act", [
    lambda handle: handle.result(),
    lambda handle: list(handle),
    lambda handle: handle.cancel(),
], ids=["result", "iterate", "cancel"])
def test_a_handle_live_at_fork_refuses_in_the_child_instead_of_waiting(gated, gate, act):
    """A request live when the process forked: in the child, ``result()``
    and iterating waited for ever on a decode thread the child lacks, and
    ``cancel()`` said it was taken. Now each refuses, saying why; the
    parent's request ends as it would have."""
    gate.arm(at=2)
    handle = gated.submit("query", question=GATED, max_tokens=6)
    gate.wait_reached()
    try:
        assert _in_child(handle, act) == REFUSED
    finally:
        gate.open()
    assert handle.result(WAIT).status is Status.COMPLETED
    assert_serves(gated)


# -- listeners that are async without being an async def ----------------------

class AsyncCall:
    async def __call__(self, handle, token):
        pass


def test_an_object_whose_call_is_async_is_refused_as_a_listener(engine):
    with pytest.raises(InvalidRequest, match="^listener: must be a plain function"):
        engine.submit("query", question="the cat", listener=AsyncCall())
    assert_serves(engine)


def test_a_listener_returning_a_coroutine_fails_its_request_naming_why(engine):
    """A lambda around an async call passes every check and returns a
    coroutine nobody awaits: its work was dropped in silence. Now its request
    fails, saying listeners are plain functions; the coroutine is closed (no
    "never awaited" warning), and the other requests are untouched."""
    made = []

    async def work(token):
        pass

    def listener(handle, token):
        made.append(coroutine := work(token))
        return coroutine

    bad = engine.submit("query", question="the cat", max_tokens=10, listener=listener)
    good = engine.submit("query", question="a dog", max_tokens=10)
    result = bad.result(WAIT)
    assert result.status is Status.FAILED
    assert "listeners are plain functions" in result.finish_reason and "aquery" in result.finish_reason
    assert good.result(WAIT).status is Status.COMPLETED
    wait_idle(engine)
    assert made and all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in made)
    assert_serves(engine)


def test_a_coroutine_a_listener_returns_at_an_end_the_engine_gave_is_closed(gated, gate):
    """Requests still in the serving loop's inbox when the engine stops
    (here a listener asked the process to stop) are ended by the loop, not
    the core, and their listeners told there; what a listener returned was
    dropped, and a coroutine among it warned "never awaited" when
    collected. Now it is closed there as the core closes one."""
    made, stopping = [], threading.Event()

    async def work(token):
        pass

    def at_end(handle, token):
        if token is None:
            made.append(coroutine := work(token))
            return coroutine
        return None

    def stop(handle, token):
        if stopping.is_set():
            raise SystemExit("stop")

    gate.arm(at=2)
    stopper = gated.submit("query", question=GATED, max_tokens=6, listener=stop)
    gate.wait_reached()  # the decode thread held inside a tick: what comes now waits in the inbox
    late = [gated.submit("query", question=q, max_tokens=4, listener=at_end) for q in ("the cat", "a dog")]
    stopping.set()
    gate.open()
    for handle in (stopper, *late):
        assert handle.result(WAIT).status is Status.FAILED
    assert all("SystemExit" in h.result(WAIT).finish_reason for h in late)
    with pytest.raises(EngineStopped, match="SystemExit"):
        gated.submit("query", question="the cat")
    assert len(made) == 2 and all(inspect.getcoroutinestate(c) == inspect.CORO_CLOSED for c in made)


def test_a_second_engine_on_a_core_another_drives_is_refused(engine):
    """``Engine(core, skills)`` took a core another engine's loop drove: two
    decode threads ticked one state machine, both numbered their requests
    from 0 ("request id 0 is in use"), and under load both engines died."""
    with pytest.raises(ValueError, match="driven by another ServingLoop"):
        Engine(engine.core, engine.skills)
    assert_serves(engine)


# -- names the caller sent, quoted in refusals ----------------------------------

@pytest.mark.parametrize("name", ["\ud800", "z" * 1_000_000], ids=["lone surrogate", "a megabyte"])
@pytest.mark.parametrize("call", [
    lambda e, n: e.submit(n, question="x"),
    lambda e, n: e.submit("query", question="x", **{n: 1}),
    lambda e, n: e.submit("query", question="x", sampling={n: 1}),
    lambda e, n: e.query("x", settings={n: 1}),
], ids=["skill", "argument", "sampling key", "settings key"])
def test_a_refusal_quotes_a_name_it_can_print_and_at_most_a_line_of_it(engine, name, call):
    """A lone surrogate in a name made a refusal that could not be printed
    or logged (UnicodeEncodeError), and a megabyte name came back whole."""
    with pytest.raises(InvalidRequest) as err:
        call(engine, name)
    text = str(err.value)
    text.encode("utf-8")  # printable, loggable
    assert len(text) < 600, len(text)
    assert_serves(engine)


# -- sampling numbers -----------------------------------------------------------

def test_a_seed_of_thousands_of_digits_is_refused_by_its_count_of_digits(engine):
    """Its refusal quoted it whole, and past 4,300 digits quoting it raises
    ValueError: a bare error instead of the refusal."""
    with pytest.raises(InvalidRequest, match=r"^sampling\.seed: must be an int in \[0, 2\*\*64\) or None, "
                                             r"got an integer of 5001 digits$"):
        engine.submit("query", question="the cat", sampling={"seed": 10 ** 5000})
    assert_serves(engine)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_sampling_number_past_a_floats_range_is_refused_naming_it(engine, field):
    """An int past a float's range raised a bare OverflowError."""
    huge = 10 ** 400
    with pytest.raises(InvalidRequest, match=rf"^sampling\.{field}: .*an integer of 401 digits, past a float's range"):
        engine.submit("query", question="the cat", sampling={field: huge})
    with pytest.raises(InvalidRequest, match=rf"settings\.{field}: .*an integer of 401 digits"):
        engine.query("the cat", settings={field: huge})
    assert_serves(engine)


@pytest.mark.parametrize("sampling", [
    {"temperature": np.float32(0.5), "top_p": np.float32(0.5), "seed": np.int64(3)},
    {"temperature": fractions.Fraction(1, 2), "top_p": fractions.Fraction(1, 2), "seed": np.uint8(3)},
], ids=["numpy", "fraction"])
def test_sampling_takes_any_real_number_and_any_integer_seed(engine, sampling):
    """numpy's numbers and Fractions are numbers: they sample exactly as the
    same plain float and int do (and a numpy ``max_tokens`` counts as its int)."""
    params = SamplingParams(**sampling)
    assert params == SamplingParams(temperature=0.5, top_p=0.5, seed=3)
    assert type(params.temperature) is float and type(params.seed) is int
    taken = engine.submit("query", question="the cat", max_tokens=np.int64(6), sampling=sampling).result(WAIT)
    plain = engine.submit("query", question="the cat", max_tokens=6,
                          sampling={"temperature": 0.5, "top_p": 0.5, "seed": 3}).result(WAIT)
    assert taken.status is Status.COMPLETED and taken.tokens == plain.tokens
    wait_idle(engine)


# -- a stream read from a listener ----------------------------------------------

def test_a_refused_read_of_a_stream_from_a_listener_leaves_its_reader_the_whole_answer(gated, gate):
    """A listener's read of another request's stream is refused (it could
    wait for its own thread); the refusal was taken for an interrupted read
    and cancelled that stream's request, cutting its reader's answer."""
    streams, refusals = [], []

    def peek(handle, token):
        if token is not None and streams:
            try:
                next(streams[0])
            except RuntimeError as err:
                refusals.append(str(err))

    gate.arm()
    mine = gated.submit("query", question=GATED, max_tokens=6, listener=peek)
    gate.wait_reached()  # the decode thread is held: the stream's request is surely live when peek reads
    streams.append(gated.stream("query", question="is there a cow", max_tokens=12))
    gate.open()
    assert mine.result(WAIT).status is Status.COMPLETED
    assert refusals and "from a listener" in refusals[0]
    text = "".join(streams[0])  # RequestFailed here was the defect
    assert streams[0].handle.result(0).status is Status.COMPLETED
    assert text == "".join(gated.stream("query", question="is there a cow", max_tokens=12))
    wait_idle(gated)


# -- a copied Handle --------------------------------------------------------------

@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_a_handle_refuses_to_be_copied_saying_to_share_it(gated, gate, copier):
    """A copy shared the tokens but not the decode thread's notifications: its
    result() never returned. Pickle and deepcopy failed on a lock, unclearly."""
    gate.arm()
    handle = gated.submit("query", question=GATED, max_tokens=6)
    gate.wait_reached()
    with pytest.raises(TypeError, match="^a Handle is one request's; share the Handle itself, not a copy$"):
        copier(handle)
    gate.open()
    assert handle.result(WAIT).status is Status.COMPLETED
    wait_idle(gated)


# -- close held up by a listener ----------------------------------------------------

def test_close_held_up_by_a_blocking_listener_warns_and_keeps_its_bound():
    """close() waits a bounded time for the decode thread; past it, it
    returned silently with the thread still running. Now it warns, naming
    the listener that holds it."""
    engine = make_engine()
    entered, release = threading.Event(), threading.Event()

    def blocking(handle, token):
        if token is not None and len(handle.tokens) == 1:
            entered.set()
            release.wait(WAIT)

    engine.submit("query", question="the cat", max_tokens=20, listener=blocking)
    assert entered.wait(WAIT)
    engine.loop.close_wait = 0.2
    try:
        with pytest.warns(RuntimeWarning, match="decode thread is still running.*held by a step or a listener"):
            engine.close()
    finally:
        release.set()
    engine.loop._thread.join(WAIT)
    assert not engine.loop._thread.is_alive()


# -- a process that exits with an engine nobody closed ---------------------------

UNCLOSED = textwrap.dedent("""
    import sys, time
    from PIL import Image
    from bubblefree import Engine
    engine = Engine.moondream_random("tiny", device="cpu")
    picture = Image.new("RGB", (64, 48), "red")
    handles = [engine.submit("query", image=picture, question="what is here " * 3, max_tokens=100)
               for _ in range(4)]
    if sys.argv[2] == "dropped":  # the engine collected first: its finalizer asked the thread to end
        del engine
    time.sleep(float(sys.argv[1]))
    print("exiting", flush=True)
""")


@pytest.mark.parametrize("how", ["kept", "dropped"])
@pytest.mark.parametrize("delay", [0.0, 0.2])
def test_a_process_exiting_with_an_engine_nobody_closed_exits_cleanly(how, delay):
    """A script that submits work and ends without ``close()``: the decode
    thread, a daemon, was still inside a torch call while the interpreter
    tore down, and the process aborted ("terminate called without an
    active exception", exit status 134) at every delay tried. Exit now ends
    the thread first, cancelling what is live."""
    done = subprocess.run([sys.executable, "-c", UNCLOSED, str(delay), how], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert (done.returncode, done.stdout) == (0, "exiting\n"), done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_a_decode_thread_held_in_a_step_is_seen_as_stalled(gated, gate):
    """A step that does not return (a hung kernel) left the thread alive and
    every check passing: ``/health`` said ok while every request timed out.
    ``stalled_for`` counts from the loop's last turn while requests wait,
    and is 0 while the engine is idle or moving."""
    assert gated.loop.stalled_for() == 0.0  # idle
    gated.run("query", question="the cat", max_tokens=3)
    time.sleep(0.05)
    assert gated.loop.stalled_for() == 0.0  # idle again after work: not stalled
    gate.arm()
    handle = gated.submit("query", question=GATED, max_tokens=6)
    gate.wait_reached()
    time.sleep(0.2)
    assert gated.loop.stalled_for() >= 0.2
    gate.open()
    assert handle.result(WAIT).status is Status.COMPLETED
    time.sleep(0.05)
    assert gated.loop.stalled_for() == 0.0
