"""The simulated GPU is a pure function of its inputs: the same plans,
timing and faults give the same event log, so a failure replays."""

from __future__ import annotations

from bubblefree.core.values import GREEDY, SamplingParams, StepFailed
from bubblefree.fake_backend import FakeBackend, Fault, Timing
from fake_plans import blocking_step, decode, drow, generation_plans, pages_for, run


def test_same_inputs_same_log_and_other_timing_other_log():
    def go(timing):
        b = FakeBackend(timing=timing, faults={2: Fault("copy")})
        plans = generation_plans([(0, 1), (2, 3, 3)], [GREEDY, SamplingParams(0.7, 0.9, 2)], 1)
        run(b, plans, pipelined=True)
        try:
            blocking_step(b, 0, decode(2, drow(0, 3, pages_for(0, 2, 2))))
        except StepFailed:
            b.release(0)
        return b

    first, second = go(Timing()), go(Timing())
    assert first.log == second.log and first.log_digest() == second.log_digest()
    assert ("fault:copy", 2, 0) in [entry[:3] for entry in first.log]
    assert go(Timing(copy=0.5)).log_digest() != first.log_digest()
