"""Hand-built plans for the simulated GPU, and the engine's tick order
written out for tests that drive the fake without the core."""

from __future__ import annotations

import attrs

from bubblefree.core.values import GREEDY, SamplePlan, StepKind, StepPlan, StepRow
from bubblefree.fake_backend.slots import SlotState

PAGE = 4


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


def image_prefill(step_id, *rows):
    return StepPlan(step_id=step_id, kind=StepKind.IMAGE_PREFILL, rows=tuple(rows))


def irow(seq, image, prompt, pages, row_slot=None, sampling=GREEDY):
    """An image prefill row: ``image`` (an ImageRef) then ``prompt``."""
    return attrs.evolve(prow(seq, prompt, pages, row_slot, sampling), image=image)


def finalize(b, slot, plan, masks=None, values=()):
    b.finalize(slot, SamplePlan(plan.step_id, tuple(masks) if masks else (None,) * len(plan.rows),
                                tuple(values)))


def blocking_step(b, slot, plan, masks=None, values=()):
    b.launch(slot, plan)
    finalize(b, slot, plan, masks, values)
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
