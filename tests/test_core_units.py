"""Unit tests of the core's pieces: tables, allocators, slots, validation.

The state machine as a whole is proven in test_pipeline_machine.py and
test_exhaustive.py; here each piece is pinned on its own, including that an
illegal move raises and leaves state unchanged (h11's rule).
"""

import attrs
import pytest

from bubblefree.core import (
    Capacity, DecodeSlot, DoubleRelease, IdPool, IllegalTransition, InvalidRequest, Phase,
    Request, SamplingParams, Sequence, SlotState, pages_needed,
)
from bubblefree.core.sequence import TRANSITIONS
from bubblefree.core.slots import SLOT_TRANSITIONS


def test_sequence_illegal_move_raises_and_leaves_phase():
    seq = Sequence(0, Request(prompt=(1,), max_tokens=2))
    for event in ("prefill", "teardown"):
        with pytest.raises(IllegalTransition):
            seq.move(event)
        assert seq.phase is Phase.QUEUED
    seq.move("admit")
    assert seq.phase is Phase.ADMITTED


def check_table(table, states, events, make, state_of):
    """Every (state, event) pair: the table's move, or IllegalTransition with
    the state unchanged (h11's rule)."""
    for state in states:
        for event in events:
            thing = make(state)
            if (state, event) in table:
                thing.move(event)
                assert state_of(thing) is table[(state, event)]
            else:
                with pytest.raises(IllegalTransition) as err:
                    thing.move(event)
                # No hazard is named for these tables: the message ends at the state.
                assert str(err.value).endswith(f": {event!r} not allowed in {state.name}")
                assert state_of(thing) is state


def test_every_phase_event_pair_is_in_the_table_or_illegal():
    check_table(TRANSITIONS, Phase, {e for (_, e) in TRANSITIONS},
                lambda phase: Sequence(0, Request(prompt=(1,), max_tokens=2), phase=phase),
                lambda seq: seq.phase)


def test_teardown_refused_while_a_step_references_the_zombie():
    # I6: a zombie's pages may still be written by a launched step.
    seq = Sequence(0, Request(prompt=(1,), max_tokens=2), phase=Phase.FINALIZED, inflight_refs=1)
    with pytest.raises(IllegalTransition):
        seq.move("teardown")
    assert seq.phase is Phase.FINALIZED
    seq.inflight_refs = 0
    seq.move("teardown")
    assert seq.phase is Phase.RELEASED


def test_slot_table():
    check_table(SLOT_TRANSITIONS, SlotState, ("launch", "finalize", "release", "abort"),
                lambda state: DecodeSlot(0, state=state), lambda slot: slot.state)


def test_abort_frees_a_busy_slot_and_only_a_busy_one():
    # A lost device's abort goes through the table: any busy slot to FREE.
    for state in (SlotState.LAUNCHED, SlotState.FINALIZED):
        slot = DecodeSlot(1, state=state)
        slot.move("abort")
        assert slot.state is SlotState.FREE
    with pytest.raises(IllegalTransition, match="DecodeSlot 1: 'abort' not allowed in FREE"):
        DecodeSlot(1).move("abort")


def test_id_pool_release_exactly_once():
    pool = IdPool("pages", 4)
    got = pool.allocate(3)
    assert got == (0, 1, 2)
    assert not pool.can_allocate(2) and pool.can_allocate(1)
    pool.release(got[:2])
    with pytest.raises(DoubleRelease):
        pool.release(got[:1])  # I6: second release of page 0
    pool.check_integrity()
    assert pool.num_free == 3 and pool.num_owned == 1
    with pytest.raises(DoubleRelease):
        pool.release((2, 2))
    pool.check_integrity()


def test_id_pool_integrity_catches_corruption():
    pool = IdPool("pages", 3)
    pool.allocate(1)
    pool._free.append(0)  # an owned page also on the free list
    with pytest.raises(AssertionError, match="I6"):
        pool.check_integrity()


@pytest.mark.parametrize("prompt,max_tokens,page,expected", [
    (1, 1, 4, 1), (4, 1, 4, 1), (4, 2, 4, 2), (3, 2, 4, 1), (5, 4, 2, 4)])
def test_pages_needed_counts_positions_fed_back(prompt, max_tokens, page, expected):
    assert pages_needed(prompt, max_tokens, page) == expected


def test_capacity_rejects_zero():
    with pytest.raises(ValueError, match="num_pages"):
        Capacity(num_pages=0, page_size=4, max_rows=1, max_seqs=1, max_prefill_tokens=1, max_context=8)


@pytest.mark.parametrize("kw,field", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                      ({"top_p": 1.5}, "top_p")])
def test_sampling_params_validation(kw, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kw)


def test_abort_fails_every_live_request_and_returns_everything():
    # A lost device: nothing in flight will commit. I7 and I6 still hold.
    from bubblefree.core import Engine, Status
    from bubblefree.fake_backend import FakeBackend
    engine = Engine(FakeBackend(num_pages=8, page_size=4))
    handles = [engine.submit(Request(prompt=(0, 1, 2), max_tokens=9)) for _ in range(4)]
    for _ in range(3):
        engine.tick()
    assert engine.scheduler.inflight and engine.scheduler.queue
    engine.abort("device lost")
    assert all(h.result.status is Status.FAILED and h.result.finish_reason == "device lost"
               for h in handles)
    engine.check_integrity()
    assert engine.scheduler.pages.num_free == 8 and not engine.has_work()


def test_a_broken_skill_fails_only_its_own_request():
    from bubblefree.core import Engine, Status
    from bubblefree.fake_backend import FakeBackend

    def bad_state():
        raise RuntimeError("boom")

    def bad_finisher(tokens, state):
        raise KeyError("nope")

    engine = Engine(FakeBackend())
    broken = engine.submit(Request(prompt=(2, 1), max_tokens=3, decode_state=bad_state))
    unfinished = engine.submit(Request(prompt=(2, 1), max_tokens=3, finisher=bad_finisher))
    fine = engine.submit(Request(prompt=(2, 1), max_tokens=3, stop_ids={0}))
    engine.run_until_idle(max_ticks=50)
    assert broken.result.status is Status.FAILED and broken.result.finish_reason == "decode state raised RuntimeError in decode_state: boom"
    assert unfinished.result.status is Status.FAILED and unfinished.result.finish_reason == "decode state raised KeyError in finish: 'nope'"
    assert fine.result.status is Status.COMPLETED and fine.result.tokens == (fine.result.tokens[0], 0)
    engine.check_integrity()
    assert engine.scheduler.pages.num_free == engine.scheduler.pages.size


@pytest.mark.parametrize("cancel_on", [1, 2])
def test_a_listener_runs_after_the_tick_and_may_cancel(cancel_on):
    # Listeners run after the tick, outside the state machine: they see
    # committed facts. Cancelling on the first token ends the request once,
    # cancelled; on its last token the request has already completed, so the
    # cancel is refused and the result stands. I3/I6 intact either way.
    from bubblefree.core import Engine, Status
    from bubblefree.fake_backend import FakeBackend
    engine = Engine(FakeBackend())
    handle = engine.submit(Request(prompt=(0, 1), max_tokens=2, stop_ids={0}))
    other = engine.submit(Request(prompt=(0, 2), max_tokens=8, stop_ids={0}))
    ends, refused = [], []

    def listener(h, token):
        if token is None:
            ends.append(h.result.status)
        elif len(h.tokens) == cancel_on:
            if not engine.cancel(h.request_id):
                refused.append(len(h.tokens))

    handle.listeners.append(listener)
    engine.run_until_idle(max_ticks=50)
    engine.check_integrity()
    if cancel_on == 1:
        assert ends == [Status.CANCELLED] and refused == [] and len(handle.tokens) == 1
    else:
        assert ends == [Status.COMPLETED] and refused == [2] and len(handle.tokens) == 2
    assert handle.result.tokens == tuple(handle.tokens) and not engine.listener_errors
    assert other.result.status is Status.COMPLETED
    assert engine.scheduler.pages.num_free == engine.scheduler.pages.size


def test_a_bounded_trace_keeps_the_newest_entries():
    # A serving engine runs for days: its event log must not grow forever.
    from bubblefree.core import Engine
    from bubblefree.fake_backend import FakeBackend
    engine = Engine(FakeBackend(zero_cost=True), trace_limit=10)
    for _ in range(12):
        engine.submit(Request(prompt=(0, 1), max_tokens=3))
    engine.run_until_idle(max_ticks=200)
    assert 10 <= len(engine.trace) <= 20
    assert engine.trace[-1][0] in ("end", "commit")


@attrs.define
class FixedMask:
    """A decode state that always names ``mask`` and never finishes."""

    mask: object

    def mask_id(self):
        return self.mask

    def advance(self, token, value):
        return False


@pytest.mark.parametrize("bad", [7, True, "1", 1.0], ids=["unregistered", "bool", "str", "float"])
def test_a_mask_id_that_is_not_a_registered_int_fails_its_own_request_only(bad):
    # Checked before the backend sees it: an unknown id would fail every row
    # sharing the step, a non-int would stop the engine.
    from bubblefree.core import Engine, Status
    from bubblefree.fake_backend import FakeBackend
    engine = Engine(FakeBackend(zero_cost=True))
    allowed = engine.register_mask(range(1, 30))
    assert bad != allowed or type(bad) is not int
    broken = engine.submit(Request(prompt=(2, 1), max_tokens=3, decode_state=lambda: FixedMask(bad),
                                   skill="point"))
    fine = engine.submit(Request(prompt=(2, 1), max_tokens=3, decode_state=lambda: FixedMask(allowed)))
    engine.run_until_idle(max_ticks=50)
    assert broken.result.status is Status.FAILED
    assert broken.result.finish_reason == f"skill 'point': mask_id() returned {bad!r}, not a registered mask id"
    assert fine.result.status is Status.COMPLETED and len(fine.result.tokens) == 3
    engine.check_integrity()


def test_a_skill_s_own_error_is_named_as_the_skill_s():
    from bubblefree.core import Engine, Status
    from bubblefree.fake_backend import FakeBackend

    def broken():
        raise RuntimeError("boom")

    engine = Engine(FakeBackend(zero_cost=True))
    h = engine.submit(Request(prompt=(2, 1), max_tokens=3, decode_state=broken, skill="detect"))
    engine.run_until_idle(max_ticks=50)
    assert h.result.status is Status.FAILED
    assert h.result.finish_reason == "skill 'detect' raised RuntimeError in decode_state: boom"


def test_each_phase_reports_whether_it_did_anything():
    # ``tick`` sums these into its own answer; a subclass that wraps a phase
    # (the exhaustive search checks integrity after each) passes them on.
    from bubblefree.core import Engine
    from bubblefree.fake_backend import FakeBackend
    engine = Engine(FakeBackend(zero_cost=True))
    engine.submit(Request(prompt=(0, 1), max_tokens=2))
    assert engine._finalize() is False and engine._commit() is False  # nothing launched
    assert engine._launch() is True
    assert engine._commit() is False  # launched, not finalized: no copy to wait for
    assert engine._finalize() is True and engine._finalize() is False
    assert engine._commit() is True and engine._commit() is False


def test_an_admitted_request_keeps_nothing_of_its_wait():
    # What the exhaustive search's state key reads: an admitted request that
    # once waited for pages is the same state as one that never did.
    from bubblefree.core import Scheduler, StepOutput
    seen = []
    sched = Scheduler(Capacity(num_pages=1, page_size=4, max_rows=2, max_seqs=2, max_prefill_tokens=8,
                               max_context=8), probe=seen.append)
    for i in range(2):
        sched.add(Sequence(i, Request(prompt=(1, 2, 3), max_tokens=2)))
    for tokens in ((1,), (1,)):  # 0 takes the one page, decodes once and ends at its length
        slot, plan = sched.plan_launch()
        sched.launched(slot, plan)
        step, _ = sched.plan_finalize()
        sched.finalized(step)
        assert sched._waited == {1} and seen == ["queued_for_pages"]
        sched.commit(sched.next_commit(), StepOutput(step.step_id, tokens), None)
    slot, plan = sched.plan_launch()  # 0 is gone: 1 is admitted, its prefill planned
    assert [r.seq_id for r in plan.rows] == [1] and sched.seqs[1].phase is Phase.ADMITTED
    assert seen == ["queued_for_pages", "admitted_after_waiting"] and sched._waited == set()


def test_a_decode_row_carries_its_sequence_s_slot_position_pages_and_sampling():
    # The scheduler builds decode rows positionally (every row of every
    # step: keyword arguments cost a third more); a reordered StepRow
    # field would hand a backend swapped values, which this catches.
    from bubblefree.core import Scheduler, StepKind, StepOutput

    cap = Capacity(num_pages=16, page_size=4, max_rows=4, max_seqs=4, max_prefill_tokens=16, max_context=16)
    sched = Scheduler(cap)
    hot = SamplingParams(temperature=0.5, seed=3)
    for i, sampling in enumerate((SamplingParams(), hot)):
        sched.add(Sequence(i, Request(prompt=(1, 2, 3), max_tokens=6, sampling=sampling)))
    for tokens in ((5, 6), (7, 8)):  # the prefill, then a decode, each committed
        slot, plan = sched.plan_launch()
        sched.launched(slot, plan)
        step, _ = sched.plan_finalize()
        sched.finalized(step)
        sched.commit(sched.next_commit(), StepOutput(step.step_id, tokens), None)
    _, plan = sched.plan_launch()
    assert plan.kind is StepKind.DECODE
    for row, sampling in zip(plan.rows, (SamplingParams(), hot), strict=True):
        s = sched.seqs[row.seq_id]
        assert (row.row_slot, row.tokens, row.position, row.pages, row.sampling, row.adapter_slot) == \
            (s.row_slot, (), 4, s.pages, sampling, None)  # prompt 3 + one decode launched: position 4
        assert (row.image, row.prompt_values) == (None, ())
    assert plan.rows[0].row_slot != plan.rows[1].row_slot and plan.rows[0].pages != plan.rows[1].pages
