"""The Engine's public surface, pinned where the proof suite does not reach:
the event trace (what seed replay hashes), handles, mask registration, tick
budgets, refused launches and probes.

Mutation testing (docs/verification.md) showed each of these could change
without any invariant test noticing; the traces below are derived by hand
from the tick order in DESIGN.md, not recorded from a run.
"""

from __future__ import annotations

import pytest

from bubblefree.core import Engine, Request, Status, StepFailed
from bubblefree.core.handle import Handle
from bubblefree.fake_backend import FakeBackend, FakeModel, Fault

MODEL = FakeModel()
PROMPT = (2, 5)  # EOS is the 2nd generated token


def tokens_of(prompt, n):
    """The model's first ``n`` tokens for ``prompt``, EOS or not (a zombie's too)."""
    out, prev = [], prompt[-1]
    for k in range(n):
        prev = MODEL.pick(prompt, len(prompt) + k, prev)
        out.append(prev)
    return out


def test_the_pipelined_trace_launches_t_plus_1_before_committing_t():
    engine = Engine(FakeBackend(zero_cost=True))
    engine.submit(Request(prompt=PROMPT, max_tokens=3, stop_ids={0}))
    engine.run_until_idle()
    t0, t1, t2 = tokens_of(PROMPT, 3)
    assert t1 == 0
    assert engine.trace == [
        ("submit", 0),
        ("launch", 0, "prefill", 0, (0,)), ("finalize", 0, (None,), None),
        ("launch", 1, "decode", 1, (0,)), ("commit", 0, (t0,), None), ("finalize", 1, (None,), None),
        # EOS at step 1's commit: step 2 already runs, so it is a zombie (the seed).
        ("launch", 2, "decode", 0, (0,)), ("commit", 1, (t1,), None), ("end", 0, "completed", "stop"),
        ("finalize", 2, (None,), None),
        ("commit", 2, (t2,), None),
    ]


def test_the_blocking_trace_runs_each_step_to_its_commit():
    engine = Engine(FakeBackend(zero_cost=True), pipelined=False)
    engine.submit(Request(prompt=PROMPT, max_tokens=3, stop_ids={0}))
    engine.run_until_idle()
    t0, t1 = tokens_of(PROMPT, 2)
    assert engine.trace == [
        ("submit", 0),
        ("launch", 0, "prefill", 0, (0,)), ("finalize", 0, (None,), None), ("commit", 0, (t0,), None),
        ("launch", 1, "decode", 0, (0,)), ("finalize", 1, (None,), None),
        ("commit", 1, (t1,), None), ("end", 0, "completed", "stop"),
    ]


def test_cancel_abort_and_refused_launch_are_traced():
    engine = Engine(FakeBackend(zero_cost=True, faults={0: Fault("launch", "no memory")}), pipelined=False)
    first = engine.submit(Request(prompt=PROMPT, max_tokens=3))
    second = engine.submit(Request(prompt=PROMPT, max_tokens=3))
    assert engine.tick()  # a refused launch is progress: its rows end
    assert first.result == second.result.__class__(0, Status.FAILED, (), "no memory")
    assert second.result.finish_reason == "no memory"
    third = engine.submit(Request(prompt=PROMPT, max_tokens=3))
    assert engine.cancel(third.request_id) and not engine.cancel(third.request_id)
    fourth = engine.submit(Request(prompt=PROMPT, max_tokens=3))
    engine.tick()
    engine.abort("device lost")
    assert fourth.result.status is Status.FAILED and fourth.result.finish_reason == "device lost"
    assert engine.trace == [
        ("submit", 0), ("submit", 1),
        ("launch_failed", 0, "no memory"), ("end", 0, "failed", "no memory"), ("end", 1, "failed", "no memory"),
        ("submit", 2), ("cancel", 2), ("end", 2, "cancelled", "cancelled"),
        ("submit", 3),
        ("launch", 1, "prefill", 0, (3,)), ("finalize", 1, (None,), None),
        ("commit", 1, tuple(tokens_of(PROMPT, 1)), None),
        ("abort", "device lost"), ("end", 3, "failed", "device lost"),
    ]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_a_refused_decode_fails_its_rows_with_the_reason(pipelined):
    engine = Engine(FakeBackend(zero_cost=True, faults={1: Fault("launch", "refused")}), pipelined=pipelined)
    h = engine.submit(Request(prompt=(0, 5), max_tokens=4))
    engine.run_until_idle(max_ticks=20)
    assert h.result.status is Status.FAILED and h.result.finish_reason == "refused"
    # Pipelined, step 1 is refused before step 0 commits: the prefill's token
    # arrives for a request that has already ended, and is dropped (I5).
    assert h.result.tokens == (() if pipelined else tuple(tokens_of((0, 5), 1)))
    engine.check_integrity()


def test_a_handle_waits_streams_and_cancels():
    engine = Engine(FakeBackend(zero_cost=True))
    streamed = engine.submit(Request(prompt=(4, 1), max_tokens=6, stop_ids={0}, tag="mine"))
    waited = engine.submit(Request(prompt=(3, 1), max_tokens=6, stop_ids={0}))
    assert list(streamed) == list(MODEL.generate((4, 1), 6))
    assert streamed.done and streamed.result.tag == "mine" and streamed.result.request_id == 0
    assert waited.wait() == waited.result and waited.result.tokens == MODEL.generate((3, 1), 6)
    late = engine.submit(Request(prompt=(0, 1), max_tokens=6))
    assert not late.done and late.cancel() and not late.cancel()
    assert late.wait().status is Status.CANCELLED


class _Idle:
    def tick(self):
        return False


@pytest.mark.parametrize("how", ["wait", "iterate"])
def test_a_handle_on_an_idle_engine_raises_instead_of_spinning(how):
    h = Handle(7, Request(prompt=(1,), max_tokens=1), _Idle())
    with pytest.raises(RuntimeError, match="request 7: engine idle"):
        h.wait() if how == "wait" else list(h)


def test_listeners_get_the_handle_each_token_and_one_end():
    engine = Engine(FakeBackend(zero_cost=True))
    h = engine.submit(Request(prompt=PROMPT, max_tokens=3, stop_ids={0}))
    heard = []
    h.listeners.append(lambda handle, token: heard.append((handle, token)))
    engine.run_until_idle()
    assert heard == [(h, t) for t in MODEL.generate(PROMPT, 3)] + [(h, None)]


def test_finisher_gets_the_committed_tokens_and_the_state():
    engine = Engine(FakeBackend(zero_cost=True))
    h = engine.submit(Request(prompt=PROMPT, max_tokens=3, stop_ids={0},
                              finisher=lambda tokens, state: (tokens, state)))
    engine.run_until_idle()
    assert h.result.output == (MODEL.generate(PROMPT, 3), None)


def test_register_mask_takes_only_token_ids_of_the_vocabulary():
    engine = Engine(FakeBackend())
    last = MODEL.vocab_size - 1
    mask = engine.register_mask([0, last])
    assert engine.allowed(mask) == {0, last}
    for bad in ([], [MODEL.vocab_size], [-1]):
        with pytest.raises(ValueError, match="non-empty set of int token ids"):
            engine.register_mask(bad)


def test_run_until_idle_stops_after_exactly_max_ticks():
    def busy_engine():
        engine = Engine(FakeBackend(zero_cost=True), pipelined=False)
        engine.submit(Request(prompt=(0, 1), max_tokens=5))
        return engine

    needed = 0
    engine = busy_engine()
    while engine.tick():
        needed += 1
    busy_engine().run_until_idle(max_ticks=needed + 1)
    engine = busy_engine()
    with pytest.raises(RuntimeError, match="still busy after 2 ticks"):
        engine.run_until_idle(max_ticks=2)
    assert sum(entry[0] == "launch" for entry in engine.trace) == 2


def test_probes_name_only_what_happened():
    seen = []
    engine = Engine(FakeBackend(zero_cost=True), probe=seen.append)
    queued = engine.submit(Request(prompt=(0, 1), max_tokens=4))
    engine.cancel(queued.request_id)  # never launched: not "in flight"
    assert "cancel_in_flight" not in seen
    running = engine.submit(Request(prompt=(0, 1), max_tokens=4))
    engine.tick()
    engine.cancel(running.request_id)
    assert seen.count("cancel_in_flight") == 1


def test_step_failed_carries_its_reason():
    err = StepFailed("copy engine hung")
    assert err.reason == "copy engine hung" and str(err) == "copy engine hung"
