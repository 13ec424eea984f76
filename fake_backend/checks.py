"""Shape checks on a plan, before anything is enqueued.

On a GPU an out-of-range page id or row slot is an out-of-bounds write into
someone else's memory, and a batch larger than the captured graph reads
padding; here each raises ``HardwareMisuse`` naming the field, before the
backend changes any state.
"""

from __future__ import annotations

from bubblefree.core.backend import Capacity
from bubblefree.core.values import SamplePlan, SamplingParams, StepKind, StepPlan
from bubblefree.fake_backend.errors import HardwareMisuse


def check_plan(plan: StepPlan, cap: Capacity, vocab_size: int, last_step_id: int | None) -> None:
    def bad(why: str) -> HardwareMisuse:
        return HardwareMisuse(f"step {plan.step_id}: {why}")

    if not isinstance(plan, StepPlan) or not isinstance(plan.kind, StepKind):
        raise HardwareMisuse(f"launch takes a StepPlan, got {plan!r}")
    # I2 rests on launch order being step order; a step id is never reused
    # once its forward was enqueued.
    if last_step_id is not None and plan.step_id <= last_step_id:
        raise bad(f"step ids must increase; the last launched was {last_step_id}")
    if not plan.rows:
        raise bad("a step with no rows")
    if len(plan.rows) > cap.max_rows:
        raise bad(f"{len(plan.rows)} rows, capacity is {cap.max_rows}")
    prefill = plan.kind is StepKind.PREFILL
    if prefill and sum(len(r.tokens) for r in plan.rows) > cap.max_prefill_tokens:
        raise bad(f"more than {cap.max_prefill_tokens} prefill tokens")
    seen_seqs: set[int] = set()
    seen_slots: set[int] = set()
    seen_pages: set[int] = set()
    for row in plan.rows:
        who = f"row of seq {row.seq_id}"
        if row.seq_id in seen_seqs:
            raise bad(f"seq {row.seq_id} appears twice")
        if not 0 <= row.row_slot < cap.max_seqs:
            raise bad(f"{who}: row_slot {row.row_slot} out of range [0, {cap.max_seqs})")
        if row.row_slot in seen_slots:
            raise bad(f"{who}: row_slot {row.row_slot} shared by two rows")
        if prefill and not row.tokens:
            raise bad(f"{who}: a prefill row needs its prompt tokens")
        if not prefill and row.tokens:
            raise bad(f"{who}: a decode row's input is read on the device; tokens must be ()")
        if any(not 0 <= t < vocab_size for t in row.tokens):
            raise bad(f"{who}: token ids must be in [0, {vocab_size})")
        if row.position < 0 or row.position + row.num_tokens > cap.max_context:
            raise bad(f"{who}: positions {row.position}..{row.position + row.num_tokens - 1} "
                      f"outside the context of {cap.max_context}")
        if any(not 0 <= p < cap.num_pages for p in row.pages):
            raise bad(f"{who}: page ids must be in [0, {cap.num_pages}), got {row.pages}")
        if len(set(row.pages)) != len(row.pages):
            raise bad(f"{who}: a page appears twice in one page table {row.pages}")
        if seen_pages.intersection(row.pages):
            raise bad(f"{who}: pages {sorted(seen_pages.intersection(row.pages))} shared with another row")
        last = row.position + row.num_tokens - 1
        if last // cap.page_size >= len(row.pages):
            raise bad(f"{who}: writes position {last}, beyond its {len(row.pages)} pages of {cap.page_size}")
        if row.adapter_slot is not None and not 0 <= row.adapter_slot < cap.num_adapter_slots:
            raise bad(f"{who}: adapter_slot {row.adapter_slot} out of range [0, {cap.num_adapter_slots})")
        if not isinstance(row.sampling, SamplingParams):
            raise bad(f"{who}: sampling must be SamplingParams")
        seen_seqs.add(row.seq_id)
        seen_slots.add(row.row_slot)
        seen_pages.update(row.pages)


def check_sample(sample: SamplePlan, plan: StepPlan, masks: dict[int, frozenset[int]]) -> None:
    """Unknown mask ids are a ValueError (a caller error, as the protocol says)."""
    if not isinstance(sample, SamplePlan):
        raise HardwareMisuse(f"finalize takes a SamplePlan, got {sample!r}")
    if sample.step_id != plan.step_id:
        raise HardwareMisuse(f"finalize of step {sample.step_id} into a slot holding step {plan.step_id}")
    if len(sample.mask_ids) != len(plan.rows):
        raise HardwareMisuse(f"step {plan.step_id}: {len(sample.mask_ids)} mask ids for {len(plan.rows)} rows")
    for mask_id in sample.mask_ids:
        if mask_id is not None and mask_id not in masks:
            raise ValueError(f"step {plan.step_id}: unknown mask id {mask_id!r}")
