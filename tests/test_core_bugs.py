"""Regression tests for core bugs the proof suite found, now fixed; each
docstring says what was wrong."""

from __future__ import annotations

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
