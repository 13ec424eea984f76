"""Regression tests for core bugs the proof suite found, now fixed; each
docstring says what was wrong."""

from __future__ import annotations

import pytest

from bubblefree.core import Engine, Request, Status
from bubblefree.fake_backend import FakeBackend


def test_the_trace_records_the_ending_the_caller_got():
    """When a finisher raises, ``Engine._finished`` answers FAILED (a skill's
    bug fails its request) but appended ``seq.status`` — COMPLETED — to the
    trace, so the replay record and the log disagree with the answer (I7:
    one ending, the same everywhere). Fixed: the trace records the
    ending the caller got."""
    def broken(tokens, state):
        raise KeyError("bug")

    engine = Engine(FakeBackend(zero_cost=True))
    h = engine.submit(Request(prompt=(1, 1), max_tokens=2, stop_ids={0}, finisher=broken))
    engine.run_until_idle()
    assert h.result.status is Status.FAILED
    assert ("end", 0, h.result.status.value, h.result.finish_reason) in engine.trace


def test_run_until_idle_does_not_call_an_idle_engine_busy():
    """With ``max_ticks`` equal to the ticks the work takes, ``run_until_idle``
    raised "engine still busy after n ticks" although the n-th tick finished
    everything. Fixed: it raises only while work remains."""
    def engine():
        e = Engine(FakeBackend(zero_cost=True))
        e.submit(Request(prompt=(0, 1), max_tokens=3))
        return e

    e, needed = engine(), 0
    while e.tick():
        needed += 1
    engine().run_until_idle(max_ticks=needed)


class _Counting:
    """A decode state that allows any token and counts what it is given."""

    def __init__(self) -> None:
        self.advanced: list[int] = []

    def mask_id(self):
        return None

    def advance(self, token, value):
        self.advanced.append(token)
        return False


@pytest.mark.parametrize("pipelined", [True, False, "auto"])
def test_one_state_handed_to_two_requests_admitted_together_fails_both(pipelined):
    """A ``decode_state`` that returned one object to two requests admitted in
    the same step: neither had consumed a token, so the skill set's check of
    a used state passed, and the state advanced on both requests' tokens,
    each request's output the two merged. Fixed: the core refuses at
    admission a state another live request holds; the second fails naming
    the holder, with no output, and the holder fails too, with none (the
    factory that handed its state out again may have reset it)."""
    shared = _Counting()
    engine = Engine(FakeBackend(zero_cost=True), pipelined=pipelined)
    outputs = []
    reqs = [Request(prompt=prompt, max_tokens=4, decode_state=lambda: shared,
                    finisher=lambda tokens, state: outputs.append(state) or tuple(state.advanced))
            for prompt in ((1, 2), (3, 4))]
    first, second = (engine.submit(r) for r in reqs)
    engine.run_until_idle()
    assert first.result.status is Status.FAILED and first.result.output is None
    assert first.result.finish_reason == ("decode state: decode_state returned this request's state to "
                                          "request 1 too: each request needs a fresh state")
    assert shared.advanced == []  # failed at admission, before any token
    assert second.result.status is Status.FAILED and second.result.tokens == ()
    assert second.result.output is None and outputs == []  # neither finisher ran
    assert second.result.finish_reason == (
        "decode state: decode_state returned the state request 0 holds: each request needs a fresh state")
    engine.scheduler.check_integrity()
    assert not engine.scheduler.seqs  # every resource back (I6)
    # Once the holder has ended, its state is no longer held: the core lets
    # it go to a new request (a used state is the skill set's to refuse).
    third = engine.submit(Request(prompt=(1, 2), max_tokens=4, decode_state=lambda: shared))
    engine.run_until_idle()
    assert third.result.status is Status.COMPLETED
