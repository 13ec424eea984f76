"""The simulated GPU in time: faults arrive as StepFailed and the backend
serves on; the bubble is measured right on schedules checked by hand, and
any timing keeps the tokens and the stream order (I1, I8)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.core.values import GREEDY, SamplingParams, StepFailed
from bubblefree.fake_backend import FakeBackend, Fault, HardwareMisuse, Timing, by_step
from bubblefree.fake_backend.stats import Stats
from fake_plans import (
    SlotState, blocking_step, decode, drow, finalize, generation_plans, launched, prefill, prow,
    reference, run,
)


# ------------------------------------------------------------------- faults
def test_launch_fault_refuses_the_forward_and_fires_once():
    b = FakeBackend(faults={1: Fault("launch", "oom")})
    blocking_step(b, 0, prefill(0, prow(0, (0, 3), (0,))))
    with pytest.raises(StepFailed) as err:
        b.launch(1, decode(1, drow(0, 2, (0,))))
    assert err.value.reason == "oom"
    assert b.slots[1].state is SlotState.FREE and b.stats().steps == 1
    out = blocking_step(b, 1, decode(1, drow(0, 2, (0,))))  # same id, next plan: served
    assert out.tokens == (reference(b.model, (0, 3), 2)[1],)


@pytest.mark.parametrize("kind", ["sampling", "copy"])
def test_wait_fault_is_reported_then_the_next_step_is_served(kind):
    b = FakeBackend(faults={1: Fault(kind, f"{kind} broke")}, timing=Timing(copy=3.0))
    pages = (0, 1)
    plans = [prefill(0, prow(0, (0, 7, 7), pages))] + [decode(k, drow(0, 2 + k, pages)) for k in (1, 2, 3)]
    b.launch(0, plans[0])
    finalize(b, 0, plans[0])
    b.launch(1, plans[1])
    assert b.wait(0).step_id == 0
    b.release(0)
    finalize(b, 1, plans[1])
    b.launch(0, plans[2])  # pipelined: queued behind the step that will fail
    with pytest.raises(StepFailed, match=f"{kind} broke"):
        b.wait(1)
    assert b.clock.host >= b.slots[1].copy_end
    with pytest.raises(HardwareMisuse):
        b.wait(1)
    b.release(1)
    finalize(b, 0, plans[2])
    got = [b.wait(0).tokens[0]]
    b.release(0)
    got += blocking_step(b, 1, plans[3]).tokens
    assert got == reference(b.model, (0, 7, 7), 4)[2:]


def test_finalize_fault_needs_only_a_release():
    b = FakeBackend(faults={0: Fault("finalize", "kernel")})
    plan = launched(b)
    with pytest.raises(StepFailed, match="kernel"):
        finalize(b, 0, plan)
    assert b.slots[0].state is SlotState.FAILED
    with pytest.raises(HardwareMisuse, match="already reported"):
        b.wait(0)
    b.release(0)
    b.launch(0, decode(1, drow(0, 3, (0,))))  # its tokens did land on the device


def test_fault_kind_is_checked():
    with pytest.raises(ValueError, match=r"^Fault.kind must be one of .*, got 'forward'$"):
        Fault("forward")


def test_faults_are_logged_by_kind_step_and_slot():
    b = FakeBackend(faults={1: Fault("launch"), 2: Fault("finalize")})
    blocking_step(b, 0, prefill(0, prow(0, (0, 3), (0,))))
    with pytest.raises(StepFailed):
        b.launch(1, decode(1, drow(0, 2, (0,))))
    b.launch(0, decode(2, drow(0, 2, (0,))))
    with pytest.raises(StepFailed):
        finalize(b, 0, decode(2, drow(0, 2, (0,))))
    assert [e[:3] for e in b.log if e[0].startswith("fault:") or e[0] == "finalize"] == [
        ("finalize", 0, 0), ("fault:launch", 1, 1), ("finalize", 2, 0), ("fault:finalize", 2, 0)]


# ------------------------------------------------------------------- timing
HAND = Timing(forward=1.0, sampling=0.1, copy=0.1, launch_cost=0.2, finalize_cost=0.1,
              commit_cost_per_row=0.3)


def three_steps():
    pages = (0, 1)
    return [prefill(0, prow(0, (0, 2), pages)), decode(1, drow(0, 2, pages)), decode(2, drow(0, 3, pages))]


def intervals(b, what):
    return [(s, round(t0, 9), round(t1, 9)) for (w, s, _, t0, t1) in b.log if w == what]


def test_blocking_schedule_checked_by_hand():
    b = FakeBackend(timing=HAND)
    run(b, three_steps(), pipelined=False)
    assert intervals(b, "forward") == [(0, 0.2, 1.2), (1, 1.9, 2.9), (2, 3.6, 4.6)]
    assert intervals(b, "copy") == [(0, 1.3, 1.4), (1, 3.0, 3.1), (2, 4.7, 4.8)]
    s = b.stats()
    assert s.steps == 3 and s.gpu_busy == pytest.approx(3.3)
    assert s.gpu_idle == pytest.approx(1.2) and s.gpu_span == pytest.approx(4.5)
    assert [i for _, i in s.idle_per_step] == pytest.approx([0.0, 0.6, 0.6])
    assert s.host_time == pytest.approx(5.1) and s.makespan == pytest.approx(5.1)


def test_pipelined_schedule_checked_by_hand_has_no_bubble():
    b = FakeBackend(timing=HAND)
    run(b, three_steps(), pipelined=True)
    assert intervals(b, "forward") == [(0, 0.2, 1.2), (1, 1.3, 2.3), (2, 2.4, 3.4)]
    assert intervals(b, "wait") == [(0, 0.5, 1.4), (1, 2.0, 2.5), (2, 2.9, 3.6)]
    s = b.stats()
    assert s.gpu_idle == pytest.approx(0.0) and s.gpu_busy == pytest.approx(3.3)
    assert s.host_time == pytest.approx(3.9)


def test_a_late_finalize_is_idle_charged_to_its_step():
    b = FakeBackend(timing=Timing(forward=1.0, sampling=0.5, copy=0.0, launch_cost=0.0,
                                  finalize_cost=0.0, commit_cost_per_row=0.0))
    plan = launched(b)
    b.clock.spend(3.0)  # the host is busy elsewhere (a commit) before finalizing
    finalize(b, 0, plan)
    assert dict(b.stats().idle_per_step) == {0: pytest.approx(2.0)}


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_timing_keeps_tokens_and_stats_consistent(data):
    dur = st.floats(0.0, 3.0, allow_nan=False)
    per_step = {name: {k: data.draw(dur) for k in range(5)} for name in ("forward", "sampling", "copy")}
    timing = Timing(forward=by_step(per_step["forward"], 1.0), sampling=by_step(per_step["sampling"], 0.1),
                    copy=by_step(per_step["copy"], 0.1), launch_cost=data.draw(dur),
                    finalize_cost=data.draw(dur), commit_cost_per_row=data.draw(dur))
    pipelined = data.draw(st.booleans())
    plans = generation_plans([(0, 1, 2), (0, 5)], [GREEDY, SamplingParams(1.0, 1.0, 4)], 4)
    b = FakeBackend(timing=timing)
    outs = run(b, plans, pipelined)
    assert outs == run(FakeBackend(), plans, pipelined=False)
    s = b.stats()
    compute = b.clock.compute.intervals
    for (_, _, _, end), (_, _, start, _) in zip(compute, compute[1:]):
        assert start >= end  # I1: one in-order stream
    sampled = {sid: end for sid, what, _, end in compute if what == "sampling"}
    copies = [(sid, t0, t1) for (w, sid, _, t0, t1) in b.log if w == "copy"]
    waits = {sid: t1 for (w, sid, _, _, t1) in b.log if w == "wait"}
    for sid, t0, t1 in copies:
        assert t0 >= sampled[sid] and waits[sid] >= t1
    assert s.gpu_busy + s.gpu_idle == pytest.approx(s.gpu_span)
    assert sum(i for _, i in s.idle_per_step) == pytest.approx(s.gpu_idle)
    assert s.makespan >= max(s.host_time, s.gpu_last)


def test_zero_cost_is_all_zero_and_exclusive_with_timing():
    b = FakeBackend(zero_cost=True)
    outs = run(b, three_steps(), pipelined=True)
    assert len(outs) == 3 and all(t0 == t1 == 0.0 for (*_, t0, t1) in b.log)
    assert b.stats().gpu_busy == 0.0 and b.stats().host_time == 0.0
    with pytest.raises(ValueError):
        FakeBackend(zero_cost=True, timing=Timing())


def test_negative_duration_is_refused():
    b = FakeBackend(timing=Timing(forward=-1.0))
    with pytest.raises(ValueError):
        launched(b)


def test_durations_chosen_per_step_see_that_steps_work():
    """A duration given as a function gets the step it is chosen for (its id
    and launch index); ``by_step``'s default may be such a function too."""
    seen: list[tuple[str, int, int]] = []

    def noting(name):
        def cost(work):
            seen.append((name, work.step_id, work.index))
            return 0.1
        return cost

    b = FakeBackend(timing=Timing(forward=by_step({1: 2.0}, lambda w: 1.0 + w.index),
                                  launch_cost=noting("launch"), finalize_cost=noting("finalize")))
    run(b, three_steps(), pipelined=False)
    assert [(s, round(t1 - t0, 9)) for s, t0, t1 in intervals(b, "forward")] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert seen == [(name, k, k) for k in range(3) for name in ("launch", "finalize")]


def test_stats_count_forwards_and_the_copy_queue():
    assert FakeBackend(timing=HAND).stats() == Stats(  # nothing ran: all zero
        steps=0, host_time=0.0, gpu_busy=0.0, gpu_idle=0.0, idle_per_step=(), gpu_first=0.0, gpu_last=0.0,
        copy_busy=0.0, makespan=0.0)
    b = FakeBackend(timing=HAND)
    run(b, three_steps(), pipelined=False)
    s = b.stats()
    assert (s.steps, s.copy_busy) == (3, pytest.approx(0.3))
    b.launch(0, decode(3, drow(0, 4, (0, 1))))  # a forward without its sampling yet
    assert b.stats().steps == 4


def test_a_negative_duration_is_refused_naming_it_and_its_step():
    b = FakeBackend(timing=Timing(launch_cost=by_step({1: -0.5}, 0.1)))
    plans = three_steps()
    blocking_step(b, 0, plans[0])
    with pytest.raises(ValueError, match=r"^Timing.launch_cost for step 1 must be >= 0, got -0.5$"):
        b.launch(1, plans[1])
