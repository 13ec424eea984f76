"""``FakeBackend``: the ``core.protocol.Backend`` contract on a simulated GPU.

Each call does what the CUDA backend does, in virtual time (``clock``), on
simulated memory (``kv``), through the contract's slot table (``slots``):

    launch    check the plan (the contract's checks, step order, and that no other
              sequence's device work still uses its pages and slots); run the forward's KV writes and read-back
              (compute order, I1); enqueue it on the compute queue
    finalize  sample each row (``model``) under its mask, and the value it
              asks; write the token (or the value's marker) to the row's device
              slot; record an event; enqueue the host copy on the copy queue
              behind that event
    wait      advance the host to the copy's end; read the host buffer,
              which only the landed copy has written
    release   the commit is done with the buffer (I4)

Work takes effect at enqueue time. That is exact, not a shortcut: the compute
queue is in order, so device state as seen by the n-th enqueued item is the
state after the n-1 before it, whenever the host happens to enqueue it.

What the data model cannot see is *when* the device touches memory relative
to the host's decisions: a forward enqueued at t runs later, while the host
already plans the next step. So ownership is kept on the device's timeline
(``owners``): a plan that names a page, row slot or adapter slot another
sequence's forward or sampling still uses at that moment raises
``KVCorruption`` (I6), however the data would have turned out.

The fake decides nothing: durations and faults come from the caller
(``Timing``, ``faults``), so every run is a pure function of its inputs.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import attrs

from bubblefree.core.protocol import NUM_SLOTS, Capacity, check_mask, check_plan, check_sample, slot_index
from bubblefree.core.values import ImageRef, SamplePlan, StepFailed, StepOutput, StepPlan
from bubblefree.fake_backend.checks import check_step_order
from bubblefree.fake_backend.clock import Clock
from bubblefree.fake_backend.errors import HardwareMisuse
from bubblefree.fake_backend.images import image_ref, value_marker
from bubblefree.fake_backend.kv import DeviceMemory
from bubblefree.fake_backend.model import FakeModel
from bubblefree.fake_backend.owners import Ownership
from bubblefree.fake_backend.slots import Slot, SlotState
from bubblefree.fake_backend.stats import Stats, measure
from bubblefree.fake_backend.timing import Fault, Timing, Work


@attrs.define(eq=False, kw_only=True)
class FakeBackend:
    """``faults`` maps a step id to the ``Fault`` that hits it. It is consulted
    once per launch call, and a fault fires at most once: an engine that
    reuses a refused step's id for its next plan gets that plan through."""

    model: FakeModel = attrs.Factory(FakeModel)
    timing: Timing | None = None
    faults: Mapping[int, Fault] = attrs.Factory(dict)
    zero_cost: bool = False  # every duration and host cost 0
    num_pages: int = 64
    page_size: int = 4
    max_rows: int = 8
    max_seqs: int = 16
    max_prefill_tokens: int = 64
    max_context: int = 256
    num_adapter_slots: int = 2
    images: bool = True  # runs IMAGE_PREFILL steps
    values: bool = True  # decodes the values a SamplePlan asks (a region head)
    image_length: int = 3  # prefix positions of an image from ``image_ref``

    log: list[tuple] = attrs.field(init=False, factory=list)  # (what, step_id, slot, start, end)
    clock: Clock = attrs.field(init=False, factory=Clock)
    memory: DeviceMemory = attrs.field(init=False)
    owners: Ownership = attrs.field(init=False, factory=Ownership)  # pages and slots in device time (I6)
    slots: tuple[Slot, ...] = attrs.field(init=False)
    _capacity: Capacity = attrs.field(init=False)
    _masks: dict[int, frozenset[int]] = attrs.field(init=False, factory=dict)
    _mask_ids: dict[frozenset[int], int] = attrs.field(init=False, factory=dict)
    _works: dict[int, Work] = attrs.field(init=False, factory=dict)  # slot -> its step's Work
    _launches: int = attrs.field(init=False, default=0)
    _last_step_id: int | None = attrs.field(init=False, default=None)
    _fired: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        if self.zero_cost and self.timing is not None:
            raise ValueError("zero_cost replaces timing; pass one or the other")
        if self.timing is None:
            self.timing = Timing.zero() if self.zero_cost else Timing()
        self._capacity = Capacity(
            num_pages=self.num_pages, page_size=self.page_size, max_rows=self.max_rows,
            max_seqs=self.max_seqs, max_prefill_tokens=self.max_prefill_tokens,
            max_context=self.max_context, num_adapter_slots=self.num_adapter_slots,
            images=self.images, values=self.values)
        self.memory = DeviceMemory(self.page_size)
        self.slots = tuple(Slot(i) for i in range(NUM_SLOTS))

    # ------------------------------------------------------------- protocol
    @property
    def capacity(self) -> Capacity:
        return self._capacity

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def register_mask(self, allowed: frozenset[int]) -> int:
        allowed = check_mask(allowed, self.vocab_size)
        if allowed not in self._mask_ids:
            self._mask_ids[allowed] = len(self._masks)
            self._masks[len(self._masks)] = allowed
        return self._mask_ids[allowed]

    def launch(self, slot: int, plan: StepPlan) -> None:
        s = self._slot(slot)
        nxt = s.check("launch")
        check_plan(plan, self._capacity, self.vocab_size, error=HardwareMisuse)
        check_step_order(plan, self._last_step_id)
        self.owners.claim(plan, self.clock.host)  # raises before any write
        writes, contexts = self.memory.forward(plan)  # raises before any write
        work = Work(step_id=plan.step_id, index=self._launches, kind=plan.kind, rows=len(plan.rows),
                    tokens=sum(r.num_tokens for r in plan.rows))
        fault = self.faults.get(plan.step_id)
        if fault is not None and plan.step_id in self._fired:
            fault = None
        refused = fault is not None and fault.kind == "launch"
        cost = self.timing.of("launch_cost", work)
        duration = 0.0 if refused else self.timing.of("forward", work)

        self._launches += 1
        t0, t1 = self.clock.spend(cost)
        self.log.append(("launch", plan.step_id, slot, t0, t1))
        if refused:
            # Nothing was enqueued: the slot stays FREE and the device unchanged.
            self._fire("launch", plan.step_id, slot)
            raise StepFailed(fault.reason)
        self.memory.store(writes)
        start, end = self.clock.compute.enqueue(plan.step_id, "forward", self.clock.host, duration)
        self.log.append(("forward", plan.step_id, slot, start, end))
        self.owners.forward(plan, end, self.clock.host)
        s.state, s.plan, s.contexts, s.fault = nxt, plan, contexts, fault
        self._works[slot] = work
        self._last_step_id = plan.step_id

    def finalize(self, slot: int, sample: SamplePlan) -> None:
        s = self._slot(slot)
        nxt = s.check("finalize")
        plan, work = s.plan, self._works[slot]
        check_sample(sample, plan, self._masks, values=self.values, error=HardwareMisuse)
        tokens, values, inputs = [], [], []
        for i, (ctx, row, mask_id) in enumerate(zip(s.contexts, plan.rows, sample.mask_ids)):
            allowed = None if mask_id is None else self._masks[mask_id]
            token = self.model.pick(ctx.prompt, ctx.position, ctx.prev_token, row.sampling, allowed)
            kind = sample.values[i] if sample.values else None
            value = None if kind is None else self.model.value(
                ctx.prompt, ctx.position, ctx.prev_token, token, kind, row.sampling)
            tokens.append(token)
            values.append(value)
            inputs.append(token if kind is None else value_marker(kind, value))
        output = StepOutput(step_id=plan.step_id, tokens=tuple(tokens),
                            values=tuple(values) if sample.values else None)
        cost = self.timing.of("finalize_cost", work)
        sampling = self.timing.of("sampling", work)
        faulted = s.fault is not None and s.fault.kind == "finalize"
        copy = 0.0 if faulted else self.timing.of("copy", work)

        t0, t1 = self.clock.spend(cost)
        self.log.append(("finalize", plan.step_id, slot, t0, t1))
        start, end = self.clock.compute.enqueue(plan.step_id, "sampling", self.clock.host, sampling)
        self.log.append(("sampling", plan.step_id, slot, start, end))
        for ctx, next_input in zip(s.contexts, inputs):
            self.memory.sampled(ctx, next_input)  # on the device, in compute order
        self.owners.sampled(plan, end, self.clock.host)
        if faulted:
            self.owners.forget(plan.step_id)  # abandoned: nothing will read what it wrote
            s.state = SlotState.FAILED
            self._fire("finalize", plan.step_id, slot)
            raise StepFailed(s.fault.reason)
        event = self.clock.record(plan.step_id)
        start, end = self.clock.copy.enqueue(plan.step_id, "copy", event.time, copy)
        self.log.append(("copy", plan.step_id, slot, start, end))
        s.copy_end = end
        if s.fault is None:
            self.clock.deliver_at(end, lambda: self._land(s, output))
        s.state = nxt

    def wait(self, slot: int) -> StepOutput:
        s = self._slot(slot)
        nxt = s.check("wait")
        plan, work = s.plan, self._works[slot]
        commit = self.timing.of("commit_cost", work) + \
            self.timing.of("commit_cost_per_row", work) * len(plan.rows)

        t0 = self.clock.host
        self.clock.wait_until(s.copy_end)  # the copy's event only, not the device
        self.log.append(("wait", plan.step_id, slot, t0, self.clock.host))
        out = s.host_buffer
        if s.fault is None and (out is None or out.step_id != plan.step_id):
            raise HardwareMisuse(f"slot {slot}: host buffer read before step {plan.step_id}'s copy landed")
        t1, t2 = self.clock.spend(commit)
        self.log.append(("commit", plan.step_id, slot, t1, t2))
        if s.fault is not None:
            s.state = SlotState.FAILED
            self._fire(s.fault.kind, plan.step_id, slot)
            raise StepFailed(s.fault.reason)
        s.state = nxt
        return out

    def release(self, slot: int) -> None:
        s = self._slot(slot)
        s.check("release")
        step_id = s.plan.step_id
        t0, t1 = self.clock.spend(self.timing.of("release_cost", self._works.pop(slot)))
        self.log.append(("release", step_id, slot, t0, t1))
        s.clear()

    # ---------------------------------------------------------------- extras
    def stats(self) -> Stats:
        return measure(self.clock)

    def log_digest(self) -> str:
        """A stable fingerprint of the event log, for replay checks."""
        return hashlib.sha256(repr(self.log).encode()).hexdigest()

    def allowed(self, mask_id: int) -> frozenset[int]:
        return self._masks[mask_id]

    def image_ref(self, image: object) -> ImageRef:
        """An image (an int fingerprint, bytes, str, or a PIL image) as the
        core's ``ImageRef``; ``InvalidRequest`` naming ``image`` otherwise."""
        return image_ref(image, self.image_length)

    # -------------------------------------------------------------- internal
    def _slot(self, slot: int) -> Slot:
        return self.slots[slot_index(slot, HardwareMisuse)]

    def _fire(self, kind: str, step_id: int, slot: int) -> None:
        self._fired.add(step_id)
        self.log.append((f"fault:{kind}", step_id, slot, self.clock.host, self.clock.host))

    def _land(self, s: Slot, output: StepOutput) -> None:
        # I4: a copy may only land in a buffer still holding its own step.
        if s.plan is None or s.plan.step_id != output.step_id:
            raise HardwareMisuse(f"slot {s.index}: step {output.step_id}'s copy landed in a reused buffer")
        s.host_buffer = output
