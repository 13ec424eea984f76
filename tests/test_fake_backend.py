"""The simulated GPU on its own, driven with hand-built plans.

Pins what the engine's tests lean on: tokens are a pure function of
(prompt, position, previous token) whatever the batch or the timing (I8);
masks are exact (I9); every misuse real hardware would corrupt silently
raises and changes nothing (I4, I6); faults arrive as StepFailed and the
backend serves on; the bubble is measured right on a schedule checked by hand.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.core.backend import Backend
from bubblefree.core.values import GREEDY, SamplePlan, SamplingParams, StepFailed, StepKind, StepPlan, StepRow
from bubblefree.fake_backend import (
    FakeBackend, FakeModel, Fault, HardwareMisuse, KVCorruption, Timing, by_step, stable_hash,
)
from bubblefree.fake_backend.model import sample
from bubblefree.fake_backend.slots import TRANSITIONS, SlotState

PAGE = 4


# ------------------------------------------------------------------ helpers
def prefill(step_id, *rows):
    return StepPlan(step_id=step_id, kind=StepKind.PREFILL, rows=tuple(rows))


def decode(step_id, *rows):
    return StepPlan(step_id=step_id, kind=StepKind.DECODE, rows=tuple(rows))


def prow(seq, prompt, pages, row_slot=None, sampling=GREEDY):
    return StepRow(seq_id=seq, row_slot=seq if row_slot is None else row_slot, tokens=tuple(prompt),
                   position=0, pages=tuple(pages), sampling=sampling)


def drow(seq, position, pages, row_slot=None, sampling=GREEDY):
    return StepRow(seq_id=seq, row_slot=seq if row_slot is None else row_slot, tokens=(),
                   position=position, pages=tuple(pages), sampling=sampling)


def finalize(b, slot, plan, masks=None):
    b.finalize(slot, SamplePlan(plan.step_id, tuple(masks) if masks else (None,) * len(plan.rows)))


def blocking_step(b, slot, plan, masks=None):
    b.launch(slot, plan)
    finalize(b, slot, plan, masks)
    out = b.wait(slot)
    b.release(slot)
    return out


def run(b, plans, pipelined):
    """The engine's tick order: pipelined is launch t+1, commit t, finalize t+1."""
    outs, pending = [], None
    for i, plan in enumerate(plans):
        slot = i % 2
        b.launch(slot, plan)
        if pipelined and pending is not None:
            outs.append(b.wait(pending))
            b.release(pending)
        finalize(b, slot, plan)
        if pipelined:
            pending = slot
        else:
            outs.append(b.wait(slot))
            b.release(slot)
    if pending is not None:
        outs.append(b.wait(pending))
        b.release(pending)
    return outs


def pages_for(index, prompt_len, steps):
    """Sequence ``index``'s own pages: a stride of 8 keeps sequences apart."""
    n = -(-(prompt_len + steps) // PAGE)
    assert n <= 8
    return tuple(range(index * 8, index * 8 + n))


def reference(model, prompt, n, sampling=GREEDY):
    """n tokens chained through the model alone, EOS or not."""
    out, prev = [], prompt[-1]
    for k in range(n):
        prev = model.pick(tuple(prompt), len(prompt) + k, prev, sampling)
        out.append(prev)
    return out


def generation_plans(prompts, samplings, decode_steps, orders=None):
    """One prefill of all rows, then decode steps of all rows (row order per step from ``orders``)."""
    rows = [prow(i, p, pages_for(i, len(p), decode_steps + 1), sampling=s)
            for i, (p, s) in enumerate(zip(prompts, samplings))]
    plans = [prefill(0, *rows)]
    for k in range(decode_steps):
        order = orders[k] if orders else range(len(prompts))
        plans.append(decode(k + 1, *(drow(i, len(prompts[i]) + k, rows[i].pages, sampling=samplings[i])
                                     for i in order)))
    return plans


def tokens_by_seq(plans, outs):
    got: dict[int, list[int]] = {}
    for plan, out in zip(plans, outs):
        assert out.step_id == plan.step_id
        for row, token in zip(plan.rows, out.tokens):
            got.setdefault(row.seq_id, []).append(token)
    return got


# -------------------------------------------------------------------- model
def test_stable_hash_and_default_scores_are_pinned():
    # Literal values: a salted or changed hash would make runs irreproducible.
    assert stable_hash(1, 2, 3) == stable_hash(1, 2, 3) != stable_hash(1, 2, 4)
    assert stable_hash(1, 2, 3) == 0x30736AAC478E72F0
    assert FakeModel().generate((0, 5, 9), 6) == (12, 16, 3, 11, 28, 27)
    hot = SamplingParams(temperature=1.0, seed=3)  # noise from (seed, position, token)
    assert FakeModel().generate((0, 5, 9), 6, hot) == (28, 15, 8, 14, 20, 19)


def test_first_prompt_token_chooses_where_eos_falls():
    model = FakeModel()
    for k in range(1, 6):
        out = model.generate((k, 7, 3), 10)
        assert len(out) == k and out[-1] == model.eos_id and model.eos_id not in out[:-1]
        hot = model.generate((k, 7, 3), 10, SamplingParams(temperature=1.5, seed=k))
        assert len(hot) == k and hot[-1] == model.eos_id
    assert model.eos_id not in model.generate((0, 7, 3), 40)


def test_backend_tokens_follow_the_model_and_the_eos_rule():
    b = FakeBackend()
    prompt = (3, 11, 4)
    pages = pages_for(0, 3, 4)
    plans = [prefill(0, prow(0, prompt, pages))] + [decode(k + 1, drow(0, 3 + k, pages)) for k in range(3)]
    got = tokens_by_seq(plans, run(b, plans, pipelined=True))[0]
    assert got == reference(b.model, prompt, 4)
    assert got[2] == 0 and 0 not in got[:2]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_tokens_do_not_depend_on_batch_mode_or_row_order(data):
    # I8: alone or batched, pipelined or blocking, any row order: same tokens.
    n = data.draw(st.integers(1, 4), label="seqs")
    steps = data.draw(st.integers(0, 4), label="decode steps")
    prompts = [data.draw(st.lists(st.integers(0, 31), min_size=1, max_size=6)) for _ in range(n)]
    samplings = [data.draw(st.sampled_from([GREEDY, SamplingParams(0.8, 1.0, 7), SamplingParams(1.5, 0.6, 3)]))
                 for _ in range(n)]
    orders = [data.draw(st.permutations(range(n))) for _ in range(steps)]
    model = FakeModel()
    batched = generation_plans(prompts, samplings, steps, orders)
    got = tokens_by_seq(batched, run(FakeBackend(), batched, data.draw(st.booleans(), label="pipelined")))
    for i, prompt in enumerate(prompts):
        alone = generation_plans([prompt], [samplings[i]], steps)
        assert tokens_by_seq(alone, run(FakeBackend(), alone, pipelined=False))[0] == got[i]
        assert got[i] == reference(model, prompt, steps + 1, samplings[i])


def test_custom_scores_and_values_are_used():
    def scores(prompt, position, prev):
        return [1.0 if v == (prev + 1) % 8 else 0.0 for v in range(8)]

    model = FakeModel(vocab_size=8, score_fn=scores, value_fn=lambda p, pos, tok: pos + tok / 10)
    b = FakeBackend(model=model)
    out = blocking_step(b, 0, prefill(0, prow(0, (2, 6), (0,)), prow(1, (5,), (1,))))
    assert out.tokens == (7, 6)
    assert out.values == (2.7, 1.6)
    assert blocking_step(FakeBackend(), 0, prefill(0, prow(0, (2, 6), (0,)))).values is None


# -------------------------------------------------------------------- masks
@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=5),
       allowed=st.frozensets(st.integers(0, 31), min_size=1, max_size=6),
       sampling=st.sampled_from([GREEDY, SamplingParams(1.0, 1.0, 1), SamplingParams(2.0, 0.5, 9)]))
def test_masked_rows_pick_only_allowed_tokens(prompt, allowed, sampling):
    b = FakeBackend()
    mask = b.register_mask(allowed)
    plan = prefill(0, prow(0, prompt, (0, 1)), prow(1, prompt, (2, 3), sampling=sampling))
    out = blocking_step(b, 0, plan, masks=(mask, mask))
    assert set(out.tokens) <= allowed
    scores = b.model.scores(tuple(prompt), len(prompt), prompt[-1])
    assert out.tokens[0] == min(allowed, key=lambda v: (-scores[v], v))


def test_sampling_ties_and_top_p():
    assert sample([0.5, 0.9, 0.9], None, GREEDY, 0) == 1
    assert sample([0.5, 0.9, 0.9], {0, 2}, GREEDY, 0) == 2
    # top_p tiny keeps only the best token, whatever the noise.
    assert all(sample([0.1, 3.0, 0.2], None, SamplingParams(5.0, 0.01, s), 4) == 1 for s in range(20))
    drawn = {sample([0.0] * 4, None, SamplingParams(1.0, 1.0, s), 4) for s in range(40)}
    assert drawn == {0, 1, 2, 3}
    # Equal scores, top_p 0.5: the nucleus is the two lowest ids.
    drawn = {sample([0.0] * 4, None, SamplingParams(1.0, 0.5, s), 4) for s in range(40)}
    assert drawn == {0, 1}


def test_register_mask_validates_and_dedupes():
    b = FakeBackend()
    assert b.register_mask(frozenset({1, 2})) == b.register_mask(frozenset({2, 1}))
    assert b.register_mask(frozenset({3})) != b.register_mask(frozenset({1, 2}))
    for bad in (frozenset(), frozenset({32}), frozenset({-1})):
        with pytest.raises(ValueError):
            b.register_mask(bad)


def test_unknown_mask_id_is_a_value_error_and_changes_nothing():
    b = FakeBackend()
    plan = prefill(0, prow(0, (1, 2), (0,)))
    b.launch(0, plan)
    with pytest.raises(ValueError):
        b.finalize(0, SamplePlan(0, (99,)))
    assert b.slots[0].state is SlotState.LAUNCHED
    finalize(b, 0, plan)
    assert b.wait(0).tokens == (0,)


# ------------------------------------------------------------------- misuse
def launched(b, slot=0, step_id=0, seq=0):
    plan = prefill(step_id, prow(seq, (1, 2, 3), (seq,)))
    b.launch(slot, plan)
    return plan


def to_state(b, state):
    plan = None
    if state is not SlotState.FREE:
        plan = launched(b)
    if state in (SlotState.FINALIZED, SlotState.WAITED):
        finalize(b, 0, plan)
    if state is SlotState.WAITED:
        b.wait(0)
    return plan


CALLS = {
    "launch": lambda b: b.launch(0, prefill(50, prow(9, (1,), (9,)))),
    "finalize": lambda b: b.finalize(0, SamplePlan(0, (None,))),
    "wait": lambda b: b.wait(0),
    "release": lambda b: b.release(0),
}


@pytest.mark.parametrize("state", [SlotState.FREE, SlotState.LAUNCHED, SlotState.FINALIZED, SlotState.WAITED])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_slot_call_is_in_the_table_or_raises_without_side_effects(state, call):
    b = FakeBackend()
    to_state(b, state)
    log, host = list(b.log), b.clock.host
    if (call, state) in TRANSITIONS:
        CALLS[call](b)
        assert b.slots[0].state is TRANSITIONS[(call, state)]
    else:
        with pytest.raises(HardwareMisuse):
            CALLS[call](b)
        assert b.slots[0].state is state and b.log == log and b.clock.host == host


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(sorted(CALLS)), st.integers(0, 1)), max_size=25))
def test_random_call_sequences_follow_the_table(calls):
    b = FakeBackend()
    shadow = [SlotState.FREE, SlotState.FREE]
    plans = [None, None]
    for n, (call, slot) in enumerate(calls):
        expected = TRANSITIONS.get((call, shadow[slot]))
        if call == "launch":
            plan = prefill(n, prow(n % 16, (n % 5 + 1, 4), (2 * (n % 16), 2 * (n % 16) + 1)))
            act = lambda: b.launch(slot, plan)  # noqa: E731
        elif call == "finalize":
            step_id = plans[slot].step_id if plans[slot] else 0
            act = lambda: b.finalize(slot, SamplePlan(step_id, (None,)))  # noqa: E731
        else:
            act = lambda: getattr(b, call)(slot)  # noqa: E731
        if expected is None:
            with pytest.raises(HardwareMisuse):
                act()
        else:
            act()
            if call == "launch":
                plans[slot] = plan
            shadow[slot] = expected
        assert [s.state for s in b.slots] == shadow


def test_launch_into_a_slot_whose_copy_is_in_flight_names_the_hazard():
    b = FakeBackend(timing=Timing(copy=10.0))
    to_state(b, SlotState.FINALIZED)
    assert b.slots[0].host_buffer is None  # the copy has not landed
    with pytest.raises(HardwareMisuse, match="in flight"):
        b.launch(0, prefill(1, prow(1, (1,), (1,))))


def test_host_buffer_is_written_only_when_the_copy_lands():
    b = FakeBackend(timing=Timing(launch_cost=0.0, finalize_cost=0.0, forward=1.0, sampling=0.5,
                                  copy=4.0, commit_cost_per_row=0.0))
    to_state(b, SlotState.FINALIZED)
    assert b.slots[0].copy_end == pytest.approx(5.5)
    b.launch(1, prefill(1, prow(1, (1,), (1,))))
    assert b.slots[0].host_buffer is None and b.clock.host < 5.5
    out = b.wait(0)
    assert b.clock.host == pytest.approx(5.5) and b.slots[0].host_buffer is out


BAD_PLANS = {  # name: (plan, what the message must say)
    "too many rows": (prefill(0, *(prow(i, (1,), (i,)) for i in range(9))), "9 rows"),
    "no rows": (prefill(0), "no rows"),
    "page out of range": (prefill(0, prow(0, (1,), (64,))), "page ids"),
    "row slot out of range": (prefill(0, prow(0, (1,), (0,), row_slot=16)), "row_slot 16"),
    "write beyond pages": (prefill(0, prow(0, (1, 2, 3, 4, 5), (0,))), "beyond its 1 pages"),
    "page shared by rows": (prefill(0, prow(0, (1,), (0,)), prow(1, (1,), (0,))), "shared with another row"),
    "page twice in a table": (prefill(0, prow(0, (1,) * 5, (3, 3))), "twice in one page table"),
    "row slot shared": (prefill(0, prow(0, (1,), (0,), row_slot=5), prow(1, (1,), (1,), row_slot=5)),
                        "row_slot 5 shared"),
    "seq twice": (prefill(0, prow(0, (1,), (0,)), prow(0, (1,), (1,), row_slot=3)), "appears twice"),
    "prefill budget": (prefill(0, *(prow(i, (1,) * 12, (3 * i, 3 * i + 1, 3 * i + 2)) for i in range(6))),
                       "prefill tokens"),
    "decode row with tokens": (decode(0, StepRow(0, 0, (1,), 3, (0,))), "tokens must be"),
    "prefill row without tokens": (prefill(0, drow(0, 0, (0,))), "needs its prompt"),
    "token outside vocab": (prefill(0, prow(0, (32,), (0,))), "token ids"),
    "beyond context": (decode(0, drow(0, 256, tuple(range(64)) + (0,))), "outside the context"),
    "adapter slot out of range": (prefill(0, StepRow(0, 0, (1,), 0, (0,), adapter_slot=2)), "adapter_slot"),
    "decode with nothing sampled": (decode(0, drow(0, 3, (0,))), "no token was ever sampled"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_bad_plans_raise_and_leave_the_slot_free(name):
    b = FakeBackend()
    plan, why = BAD_PLANS[name]
    with pytest.raises(HardwareMisuse, match=why):
        b.launch(0, plan)
    assert b.slots[0].state is SlotState.FREE and b.log == [] and b.memory.kv == {}
    blocking_step(b, 0, prefill(0, prow(0, (1,), (0,))))  # still serves


def test_step_ids_must_increase_and_slot_ids_are_0_and_1():
    b = FakeBackend()
    blocking_step(b, 0, prefill(5, prow(0, (1,), (0,))))
    with pytest.raises(HardwareMisuse, match="increase"):
        b.launch(1, prefill(5, prow(1, (1,), (1,))))
    with pytest.raises(HardwareMisuse):
        b.launch(2, prefill(6, prow(1, (1,), (1,))))


def test_finalize_must_match_the_launched_step():
    b = FakeBackend()
    launched(b, step_id=3)
    with pytest.raises(HardwareMisuse):
        b.finalize(0, SamplePlan(4, (None,)))
    with pytest.raises(HardwareMisuse):
        b.finalize(0, SamplePlan(3, (None, None)))
    assert b.slots[0].state is SlotState.LAUNCHED


def test_decode_input_must_come_from_an_enqueued_sampling():
    # Launching t+1 before finalizing t would read a stale row slot on a GPU.
    b = FakeBackend()
    pages = (0, 1)
    blocking_step(b, 0, prefill(0, prow(0, (0, 4, 4), pages)))
    b.launch(0, decode(1, drow(0, 3, pages)))
    with pytest.raises(HardwareMisuse, match="not enqueued"):
        b.launch(1, decode(2, drow(0, 4, pages)))
    finalize(b, 0, decode(1, drow(0, 3, pages)))
    b.launch(1, decode(2, drow(0, 4, pages)))  # now its input exists


def test_row_slot_handed_to_another_sequence_is_detected():
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 4), (0,), row_slot=3)))
    blocking_step(b, 1, prefill(1, prow(1, (0, 5), (1,), row_slot=3)))
    with pytest.raises(HardwareMisuse, match="another sequence"):
        b.launch(0, decode(2, drow(0, 2, (0,), row_slot=3)))


# ----------------------------------------------------------------------- KV
@pytest.mark.parametrize("thief_pages, where", [
    ((1, 2), "position 4"),  # another sequence's entries at other positions
    ((0, 2), "position 0"),  # another sequence's entries at the very same positions
])
def test_page_reused_while_owned_is_detected_and_changes_nothing(thief_pages, where):
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 1, 2, 3, 4), (0, 1))))
    blocking_step(b, 1, prefill(1, prow(1, (0, 9, 9), thief_pages)))  # a page still seq 0's
    kv = dict(b.memory.kv)
    with pytest.raises(KVCorruption, match=where):
        b.launch(0, decode(2, drow(0, 5, (0, 1))))
    assert b.memory.kv == kv and b.slots[0].state is SlotState.FREE
    blocking_step(b, 0, decode(2, drow(1, 3, thief_pages)))  # seq 1 reads its own KV fine


def test_wrong_page_table_is_detected():
    # Full pages: every position holds seq 0's KV, only at the wrong place.
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 1, 2, 3, 4, 5, 6, 7), (0, 1))))
    with pytest.raises(KVCorruption, match="holds seq 0 position 4"):
        b.launch(1, decode(1, drow(0, 8, (1, 0, 2))))
    blocking_step(b, 1, decode(1, drow(0, 8, (0, 1, 2))))


def test_model_reads_its_prompt_back_from_the_kv():
    # Chunked prefill: the second chunk's tokens depend on the first chunk's KV.
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 5, 6, 7), (0, 1))))
    out = blocking_step(b, 1, prefill(1, StepRow(0, 0, (8, 9), 4, (0, 1))))
    prompt = (0, 5, 6, 7, 8, 9)
    assert out.tokens == (b.model.pick(prompt, 6, 9),)
    # Prompt KV may not follow generated KV: a chunk after a decode is refused.
    blocking_step(b, 0, decode(2, drow(0, 6, (0, 1))))
    with pytest.raises(KVCorruption, match="after generated"):
        b.launch(1, prefill(3, StepRow(0, 0, (1,), 7, (0, 1))))


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
    with pytest.raises(ValueError):
        Fault("forward")


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


# -------------------------------------------------------------- determinism
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


def test_satisfies_the_backend_protocol_with_its_capacity():
    b = FakeBackend(num_pages=8, page_size=2, max_rows=3)
    assert isinstance(b, Backend)
    cap = b.capacity
    assert (cap.num_pages, cap.page_size, cap.max_rows, cap.max_seqs, cap.max_prefill_tokens,
            cap.max_context, cap.num_adapter_slots) == (8, 2, 3, 16, 64, 256, 2)
    assert b.vocab_size == 32 and FakeBackend(model=FakeModel(vocab_size=50)).vocab_size == 50
