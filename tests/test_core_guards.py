"""Every guard in the core, hit on purpose: it raises, its message names the
invariant or the field, and the state it guards is left as it was (h11's
rule). Boundaries are pinned from both sides: the largest request a backend
takes is accepted, one more is refused.

Mutation testing (docs/verification.md) showed which of these nothing else
reached: a guard that never fires in a correct run is only proven by a test
that breaks the state for it.
"""

from __future__ import annotations

import pytest

from bubblefree.core import (
    Capacity, DecodeSlot, DoubleRelease, Engine, IdPool, IllegalTransition, InvalidRequest,
    InvariantViolation, Phase, Request, Scheduler, Sequence, SlotState, StepOutput,
)
from bubblefree.fake_backend import FakeBackend

CAP = Capacity(num_pages=16, page_size=2, max_rows=4, max_seqs=4, max_prefill_tokens=8, max_context=16)


# -------------------------------------------------------------- allocators
def test_id_pool_messages_name_the_pool_and_the_ids():
    with pytest.raises(ValueError, match="pages: size must be >= 0, got -1"):
        IdPool("pages", -1)
    pool = IdPool("pages", 3)
    with pytest.raises(RuntimeError, match="pages: asked for 4, only 3 free"):
        pool.allocate(4)
    pool.allocate(2)
    with pytest.raises(DoubleRelease, match=r"pages: release of ids not held: \[2\]"):
        pool.release((1, 2))
    with pytest.raises(DoubleRelease, match=r"release of ids not held: \[1, 1\]"):
        pool.release((1, 1))
    assert pool.num_owned == 2


def test_a_released_id_is_handed_out_lowest_first_again():
    pool = IdPool("pages", 4)
    assert pool.allocate(3) == (0, 1, 2)
    pool.release((0, 1))
    assert pool.allocate(1) == (0,)


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: p._free.append(p._free[-1]), "an id is free twice"),
    (lambda p: p._free.append(0), r"ids both free and owned: \[0\]"),
    (lambda p: p._owned.discard(0), "free 2 \\+ owned 0 != total 3"),
])
def test_id_pool_integrity_names_what_is_wrong_I6(corrupt, message):
    pool = IdPool("pages", 3)
    pool.allocate(1)
    corrupt(pool)
    with pytest.raises(AssertionError, match=f"I6 pages: {message}"):
        pool.check_integrity()


def test_capacity_takes_ones_and_names_a_zero():
    Capacity(num_pages=1, page_size=1, max_rows=1, max_seqs=1, max_prefill_tokens=1, max_context=1)
    with pytest.raises(ValueError, match="Capacity.max_rows must be >= 1, got 0"):
        Capacity(num_pages=1, page_size=1, max_rows=0, max_seqs=1, max_prefill_tokens=1, max_context=1)


# ------------------------------------------------------------------ tables
def test_illegal_moves_name_the_thing_the_move_and_the_state():
    seq = Sequence(7, Request(prompt=(1,), max_tokens=2))
    with pytest.raises(IllegalTransition, match="sequence 7: 'prefill' not allowed in QUEUED"):
        seq.move("prefill")
    seq.phase, seq.inflight_refs = Phase.FINALIZED, 1
    with pytest.raises(IllegalTransition, match="sequence 7: teardown with inflight_refs=1"):
        seq.move("teardown")
    slot = DecodeSlot(1)
    with pytest.raises(IllegalTransition, match="DecodeSlot 1: 'finalize' not allowed in FREE"):
        slot.move("finalize")
    assert slot.state is SlotState.FREE and seq.phase is Phase.FINALIZED


# --------------------------------------------------------------- scheduler
def two_steps_in_flight(max_tokens: int = 4) -> tuple[Scheduler, list]:
    """One sequence in two launched, finalized steps: a prefill and a decode."""
    sched = Scheduler(CAP)
    sched.add(Sequence(0, Request(prompt=(1, 2), max_tokens=max_tokens)))
    steps = []
    for _ in range(2):
        slot, plan = sched.plan_launch()
        step = sched.launched(slot, plan)
        sched.plan_finalize()
        sched.finalized(step)
        steps.append(step)
    return sched, steps


def commit(sched, step, token=5):
    sched.commit(step, StepOutput(step.step_id, (token,)), None)


def test_mid_tick_a_sequence_in_two_steps_is_sound_I3():
    sched, steps = two_steps_in_flight()
    assert sched.seqs[0].inflight_refs == 2 and sched.pool.busy() == 2
    sched.check_integrity()


def test_commit_refuses_a_step_that_is_not_the_oldest_I2():
    sched, steps = two_steps_in_flight()
    with pytest.raises(InvariantViolation, match="I2: step 1 committed out of order"):
        commit(sched, steps[1])
    assert list(sched.inflight) == steps and sched.seqs[0].inflight_refs == 2


def test_commit_refuses_to_drop_a_ref_below_zero_I3():
    sched, steps = two_steps_in_flight()
    sched.seqs[0].inflight_refs = 0
    with pytest.raises(InvariantViolation, match="I3: sequence 0 inflight_refs < 0"):
        commit(sched, steps[0])


def test_launch_refuses_a_third_step_for_one_sequence_I3():
    sched = Scheduler(CAP)
    sched.add(Sequence(0, Request(prompt=(1, 2), max_tokens=4)))
    slot, plan = sched.plan_launch()
    sched.seqs[0].inflight_refs = 2
    with pytest.raises(InvariantViolation, match="I3: sequence 0 in 3 steps"):
        sched.launched(slot, plan)


def test_append_refuses_a_token_past_max_tokens_I5():
    sched, steps = two_steps_in_flight(max_tokens=2)
    sched.seqs[0].tokens = [3, 4]
    with pytest.raises(InvariantViolation, match="I5: sequence 0 past max_tokens"):
        commit(sched, steps[0])


@pytest.mark.parametrize("corrupt, message", [
    (lambda s: setattr(s.seqs[0], "pages", s.seqs[0].pages[:-1]), "I6: sequences own 2 pages, allocator says 3"),
    (lambda s: setattr(s.seqs[0], "inflight_refs", 1), "I3: sequence 0 inflight_refs=1, in 2 steps"),
    (lambda s: setattr(s.seqs[0], "tokens", [1] * 5), "I5: sequence 0 has 5 tokens"),
    (lambda s: s.inflight.reverse(), r"I2/I4: in-flight steps \[1, 0\]"),
    (lambda s: setattr(s.pool.slots[1], "state", SlotState.FREE), r"I4: steps hold slots \[0, 1\], busy slots \[0\]"),
    # I6 ownership: a sequence in flight keeps its pages; pools hold exactly
    # their sequences' ids; a step never names a released sequence.
    (lambda s: (s.pages.release(s.seqs[0].pages), setattr(s.seqs[0], "pages", ())),
     r"I6: sequence 0 \(running, inflight_refs=2\) holds pages \(\), row slot 0, adapter slot None"),
    (lambda s: s.rows.allocate(), r"I6: sequences hold row slots \[0\], the pool owns \[0, 1\]"),
    (lambda s: (s.pages.release(s.seqs[0].pages), s.rows.release((0,)), s.seqs.pop(0)),
     r"I6: in-flight steps include sequences \[0, 0\], already released"),
])
def test_check_integrity_names_what_is_wrong(corrupt, message):
    sched, _ = two_steps_in_flight()
    sched.check_integrity()
    corrupt(sched)
    with pytest.raises(InvariantViolation, match=message):
        sched.check_integrity()


@pytest.mark.parametrize("pool", ["pages", "rows", "adapters"])
def test_a_corrupt_allocator_is_named_in_the_integrity_check_I6(pool):
    sched, _ = two_steps_in_flight()
    getattr(sched, pool)._free.append(-1)
    name = {"pages": "kv pages", "rows": "row slots", "adapters": "adapter slots"}[pool]
    with pytest.raises(AssertionError, match=f"^I6 {name}: free "):
        sched.check_integrity()


def test_a_sequence_may_hold_exactly_max_tokens_I5():
    sched, _ = two_steps_in_flight()
    sched.seqs[0].tokens = [1] * 4
    sched.check_integrity()


def test_check_integrity_bounds_refs_by_two_even_when_they_agree_I3():
    sched, steps = two_steps_in_flight()
    sched.inflight.append(steps[0])  # a third step holding the sequence
    sched.seqs[0].inflight_refs = 3
    with pytest.raises(InvariantViolation, match="I3: sequence 0 inflight_refs=3, in 3 steps"):
        sched.check_integrity()


# -------------------------------------------------------------- validation
def engine(**kw) -> Engine:
    return Engine(FakeBackend(**dict(dict(num_pages=4, page_size=2, max_prefill_tokens=4, max_context=8,
                                          num_adapter_slots=0), **kw)))


@pytest.mark.parametrize("request_kw, message", [
    (dict(prompt=()), "prompt: must hold at least one token"),
    (dict(prompt=(1, 32)), r"prompt: token ids must be ints in \[0, 32\)"),
    (dict(max_tokens=0), "max_tokens: must be an int >= 1, got 0"),
    (dict(stop_ids={32}), r"stop_ids: token ids must be ints in \[0, 32\)"),
    (dict(prompt=(1,) * 5), "prompt: 5 tokens, more than the 4 one prefill takes"),
    (dict(prompt=(1, 2), max_tokens=7), r"max_tokens: prompt \(2\) \+ max_tokens \(7\) exceeds the context \(8\)"),
    (dict(adapter="lora"), "adapter: this backend has no adapter slots"),
])
def test_a_refused_request_names_its_field(request_kw, message):
    e = engine()
    with pytest.raises(InvalidRequest, match=f"^{message}$"):
        e.submit(Request(**dict(dict(prompt=(1, 2), max_tokens=2), **request_kw)))
    assert not e.handles and not e.trace


def test_the_largest_request_a_backend_takes_is_accepted():
    e = engine(num_adapter_slots=1)
    e.submit(Request(prompt=(1, 2, 3, 4), max_tokens=4, stop_ids={31}, adapter="lora"))  # 4 + 4 == context
    with pytest.raises(InvalidRequest, match="^max_tokens: needs 4 KV pages, the cache has 3$"):
        engine(num_pages=3).submit(Request(prompt=(1, 2), max_tokens=6))
    engine(num_pages=3).submit(Request(prompt=(1, 2), max_tokens=5))  # 6 positions: 3 pages, all of them
