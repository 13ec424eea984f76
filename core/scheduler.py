"""The pipeline state machine: what runs, when, and what is committed.

Sans-I/O (h11's rule), in calls as well as imports: the scheduler never
calls a backend nor a caller. The Engine asks it for a plan, hands the plan
to the backend, and reports back; what a caller must hear of (a committed
token, an end) goes to ``events`` for the Engine to deliver afterwards.
Everything that decides state lives here and in ``sequence.py`` /
``slots.py``; which sequences a step takes is ``policy.py``'s choice.

The bubble this tick removes, and the invariants by id, are pictured in
``core/__init__.py``. Kept here: I2 commits go oldest first; I3 refs count
launched, uncommitted steps (at most 2); I4 a slot is reused only after its
commit; I5 nothing after the end; I6 release exactly once, at
``finalized and inflight_refs == 0``; I7 one end each; I9 masks after commit;
I13 each row gets the value it asked for, of its kind's shape, and no other;
I14 a decode state is one live request's.
"""

from __future__ import annotations

import collections
from typing import Callable, Mapping

import attrs

from bubblefree.core.protocol import Capacity
from bubblefree.core.decode_state import ask_value, bad_mask, guarded, held_elsewhere, stolen
from bubblefree.core.events import Event, SequenceEnded, TokenCommitted
from bubblefree.core.integrity import InvariantViolation, check_integrity, check_values
from bubblefree.core.pages import IdPool, pages_needed
from bubblefree.core.policy import PREFILLS, choose_step, shortfall
from bubblefree.core.sequence import Phase, Sequence
from bubblefree.core.slots import DecodeSlot, SlotPool, SlotState, Step
from bubblefree.core.values import SamplePlan, Status, StepKind, StepOutput, StepPlan, StepRow, integer

DECODE = StepKind.DECODE  # looked up once: an enum member's lookup is slow, and the hot paths ask each step


@attrs.define(eq=False)
class Scheduler:
    capacity: Capacity
    # Called with the name of a rare situation when it happens; the proof
    # suite feeds these to hypothesis.event() to show they were reached.
    probe: Callable[[str], None] = lambda situation: None
    # The registered masks, by id (the Engine's registry, shared): a skill's
    # mask id is checked against it at finalize, the sampled token at commit (I9).
    masks: Mapping[int, frozenset[int]] = attrs.Factory(dict)
    # What happened since the Engine last looked (``take_events``).
    events: list[Event] = attrs.Factory(list)
    seqs: dict[int, Sequence] = attrs.Factory(dict)
    queue: collections.deque[int] = attrs.Factory(collections.deque)
    inflight: collections.deque[Step] = attrs.Factory(collections.deque)
    pool: SlotPool = attrs.Factory(SlotPool)
    pages: IdPool = attrs.field(init=False)
    rows: IdPool = attrs.field(init=False)
    adapters: IdPool = attrs.field(init=False)
    _next_step: int = 0
    _last_kind: StepKind | None = None
    _waited: set[int] = attrs.Factory(set)  # sequences refused admission at least once
    # I14: id(decode state) -> the live sequence holding it (``held_elsewhere``).
    # Entered at admission, left at the end.
    held: dict[int, int] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        cap = self.capacity
        self.pages = IdPool("kv pages", cap.num_pages)
        self.rows = IdPool("row slots", cap.max_seqs)
        self.adapters = IdPool("adapter slots", cap.num_adapter_slots)

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        self.queue.append(seq.seq_id)

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.inflight) or any(
            s.phase in (Phase.ADMITTED, Phase.RUNNING) for s in self.seqs.values())

    def _admit(self) -> None:
        """FIFO admission: the head waits until its pages, a row slot and an
        adapter slot are all free; nothing behind it overtakes (no starvation)."""
        while self.queue:
            seq = self.seqs[self.queue[0]]
            req = seq.request
            need = pages_needed(req.prefix_len, req.max_tokens, self.capacity.page_size)
            want_adapter = req.adapter is not None
            short = shortfall(need, want_adapter, self.pages, self.rows, self.adapters)
            if short:
                if seq.seq_id not in self._waited:
                    self._waited.add(seq.seq_id)
                    for name in short:
                        self.probe(f"queued_for_{name}")
                return
            self.queue.popleft()
            seq.pages = self.pages.allocate(need)
            (seq.row_slot,) = self.rows.allocate()
            if want_adapter:
                (seq.adapter_slot,) = self.adapters.allocate()
            seq.move("admit")
            if req.decode_state is not None:
                seq.state, error = guarded(req, "decode_state", req.decode_state)
                if error is None and seq.state is not None:
                    holder = self.held.get(id(seq.state))
                    error = held_elsewhere(req, holder)
                    seq.state_held = error is not None
                    if error is None:
                        self.held[id(seq.state)] = seq.seq_id
                    else:  # handing it out may have reset it: the holder's output is no longer sure
                        self._fail_holder(holder, seq.seq_id)
                if error is not None:
                    seq.state = None
                    self._end(seq, Status.FAILED, error)
                    self._maybe_teardown(seq)
                    continue
            if seq.seq_id in self._waited:
                self._waited.discard(seq.seq_id)
                self.probe("admitted_after_waiting")

    def plan_launch(self) -> tuple[DecodeSlot, StepPlan] | None:
        """Choose the next step for a free slot, or None. Marks nothing yet:
        ``launched`` applies the plan once the backend has accepted it."""
        slot = self.pool.free_slot()
        if slot is None:
            return None
        self._admit()
        chosen = choose_step(self.seqs.values(), self.capacity, self._last_kind)
        if chosen is None:
            return None
        kind, seqs = chosen
        if kind is DECODE:  # its input is read on the device; every row of every step: kept lean
            # Positional: keywords cost a third more a row (a unit test pins each field).
            rows = tuple(StepRow(s.seq_id, s.row_slot, (), s.kv_len, s.pages, s.request.sampling,
                                 s.adapter_slot) for s in seqs)
        else:
            rows = tuple(self._prefill_row(s) for s in seqs)
        return slot, StepPlan(step_id=self._next_step, kind=kind, rows=rows)

    def preview(self) -> tuple[StepKind, list[Sequence]] | None:
        """The step ``plan_launch`` would choose now, short of admitting the
        queue: pure, for the auto mode's choice (``ahead.outlook``)."""
        return choose_step(self.seqs.values(), self.capacity, self._last_kind)

    def _prefill_row(self, s: Sequence) -> StepRow:
        return StepRow(seq_id=s.seq_id, row_slot=s.row_slot, tokens=s.request.prompt, position=0,
                       pages=s.pages, sampling=s.request.sampling, adapter_slot=s.adapter_slot,
                       image=s.request.image, prompt_values=s.request.prompt_values)

    def launched(self, slot: DecodeSlot, plan: StepPlan) -> Step:
        """The backend accepted ``plan``: every row's sequence gains a ref (I3)."""
        committing = [st for st in self.inflight if st.kind is DECODE]
        slot.move("launch")
        step = Step(step_id=plan.step_id, kind=plan.kind, slot=slot.index,
                    seq_ids=tuple(r.seq_id for r in plan.rows))
        self._next_step += 1
        self._last_kind = plan.kind
        # The steps in flight that sample values: most steps sample none, and
        # a row's search through each step's rows, at every row of a decode
        # step, cost 64 rows x 64 a tick.
        valued = [st for st in self.inflight if st.value_kinds]
        for sid in step.seq_ids:
            s = self.seqs[sid]
            if plan.kind in PREFILLS:
                s.move("prefill")
            s.inflight_refs += 1
            s.launched += 1
            s.last_step = plan.step_id
            if s.inflight_refs > 2:
                raise InvariantViolation(f"I3: sequence {sid} in {s.inflight_refs} steps")
            if s.inflight_refs == 2:
                self.probe("two_steps_in_flight_for_one_sequence")
                if any(st.value_kinds[st.seq_ids.index(sid)] for st in valued if sid in st.seq_ids):
                    # Its input is the value's encoding, on the device: the value is not yet on the host.
                    self.probe("decode_launched_after_an_uncommitted_value")
        self.inflight.append(step)
        if self.pool.busy() == len(self.pool.slots):
            self.probe("both_slots_busy")
        if plan.kind in PREFILLS and committing:
            self.probe(f"{plan.kind.value}_launched_while_decode_in_flight")
        return step

    def launch_failed(self, plan: StepPlan, reason: str) -> None:
        """The backend refused the forward: nothing was enqueued, so no ref was
        taken; its rows fail. The step id is spent so ids stay unique."""
        self._next_step += 1
        for row in plan.rows:
            s = self.seqs[row.seq_id]
            if not s.finalized:
                self._end(s, Status.FAILED, reason)
            self._maybe_teardown(s)

    def plan_finalize(self) -> tuple[Step, SamplePlan] | None:
        """Masks for the newest launched step, from skill states as they are
        *now* — after the previous step's commit (I9)."""
        if not self.inflight or self.pool.slots[self.inflight[-1].slot].state is not SlotState.LAUNCHED:
            return None
        step = self.inflight[-1]
        masks, kinds = [], []
        for sid in step.seq_ids:
            s = self.seqs[sid]
            mask = kind = None
            if s.state is not None and not s.finalized:
                # A skill's bad mask or value kind fails its own request only:
                # ended here, it is a zombie of this step, skipped at commit.
                mask, error = guarded(s.request, "mask_id", lambda: integer(s.state.mask_id()))
                error = error or bad_mask(s.request, mask, self.masks)
                if error is None:
                    kind, error = ask_value(s.request, s.state, self.capacity.values)
                if error is not None:
                    mask = kind = None
                    self._end(s, Status.FAILED, error)
            masks.append(mask)
            kinds.append(kind)
        step.mask_ids = tuple(masks)
        step.value_kinds = tuple(kinds) if any(k is not None for k in kinds) else ()
        return step, SamplePlan(step_id=step.step_id, mask_ids=step.mask_ids, values=step.value_kinds)

    def finalized(self, step: Step, failed: str | None = None) -> None:
        self.pool.slots[step.slot].move("finalize")
        step.failed = failed

    def next_commit(self) -> Step | None:
        """The oldest in-flight step, if its sampling was issued (I2)."""
        if not self.inflight:
            return None
        step = self.inflight[0]
        if self.pool.slots[step.slot].state is not SlotState.FINALIZED:
            return None
        return step

    def commit(self, step: Step, output: StepOutput | None, failed: str | None) -> None:
        """Apply a step's host copy row by row; ``output`` is None when the step
        failed. Each appended token becomes a ``TokenCommitted`` event."""
        if self.inflight[0] is not step:
            raise InvariantViolation(f"I2: step {step.step_id} committed out of order")
        failed = failed or step.failed
        if output is not None and len(output.tokens) != len(step.seq_ids):
            failed = failed or f"backend returned {len(output.tokens)} tokens for {len(step.seq_ids)} rows"
        if output is not None and failed is None:
            check_values(step, output.values)  # I13, before anything changes
        self.inflight.popleft()
        others = {sid for st in self.inflight for sid in st.seq_ids}
        for row, sid in enumerate(step.seq_ids):
            s = self.seqs[sid]
            s.inflight_refs -= 1
            if s.inflight_refs < 0:
                raise InvariantViolation(f"I3: sequence {sid} inflight_refs < 0")
            if s.finalized:
                self.probe("zombie_commit_skipped")  # the seed: no token, no state change
                if s.inflight_refs == 0 and s.phase is Phase.FINALIZED:
                    self.probe("zombie_last_commit_frees_pages")
            elif failed is not None:
                self._end(s, Status.FAILED, failed)
            else:  # a value the row did not ask for is refused above (I13)
                value = output.values[row] if step.value_kinds else None
                self._append(s, output.tokens[row], value, step.mask_ids[row])
                if s.finalized and sid in others:
                    # The seed's zombie: it ended here, but a later step already includes it.
                    self.probe(f"{s.finish_reason}_with_successor_launched")
            self._maybe_teardown(s)
        self.pool.slots[step.slot].move("release")  # I4: only now, after reading

    def _append(self, s: Sequence, token: int, value: float | None, mask_id: int | None) -> None:
        req = s.request
        if len(s.tokens) >= req.max_tokens:
            raise InvariantViolation(f"I5: sequence {s.seq_id} past max_tokens")
        if mask_id is not None and token not in self.masks[mask_id]:
            raise InvariantViolation(
                f"I9: sequence {s.seq_id} sampled {token}, not allowed by mask {mask_id}")
        s.tokens.append(token)
        self.events.append(TokenCommitted(s.seq_id, token))
        # Looked up and judged inside: a state may lack it, or answer with
        # what has no truth value (a numpy array).
        done, error = (False, None) if s.state is None else guarded(
            req, "advance", lambda: bool(s.state.advance(token, value)))
        reason = ("stop" if token in req.stop_ids else "done" if done
                  else "length" if len(s.tokens) >= req.max_tokens else None)
        if error is not None:
            self._end(s, Status.FAILED, error)
        elif reason is not None:
            self._end(s, Status.COMPLETED, reason)

    def cancel(self, seq_id: int, status: Status = Status.CANCELLED, reason: str = "cancelled") -> bool:
        """End a live sequence at any moment (a caller's cancel, or a failure
        found outside the step, such as a raising listener). In flight, it
        becomes a zombie (I7): ended now, torn down when its last step commits."""
        s = self.seqs.get(seq_id)
        if s is None or s.finalized:
            return False
        if s.phase is Phase.QUEUED:
            self.queue.remove(seq_id)
        if s.inflight_refs > 0:
            self.probe("cancel_in_flight")
        self._end(s, status, reason)
        self._maybe_teardown(s)
        return True

    def _fail_holder(self, holder: int, seq_id: int) -> None:
        """I14: the live request whose decode state was just handed to
        ``seq_id`` too fails, with no output: a skill that pools its states
        resets one in ``start``, and the holder would complete on a state
        that lost its tokens, its output wrong and called whole."""
        s = self.seqs[holder]
        s.state_held = True
        self.cancel(holder, Status.FAILED, stolen(s.request, seq_id))

    def take_events(self) -> list[Event]:
        """What happened since the last call, in order; the outbox is emptied."""
        events, self.events = self.events, []
        return events

    def _end(self, s: Sequence, status: Status, reason: str) -> None:
        s.finish(status, reason)
        if s.state is not None:
            del self.held[id(s.state)]  # it advances no more
        self._waited.discard(s.seq_id)
        self.events.append(SequenceEnded(s))

    def _maybe_teardown(self, s: Sequence) -> None:
        """I6: release exactly once, only at finalized and inflight_refs == 0."""
        if s.phase is not Phase.FINALIZED or s.inflight_refs != 0:
            return
        if s.pages:
            self.pages.release(s.pages)
        if s.row_slot is not None:
            self.rows.release((s.row_slot,))
        if s.adapter_slot is not None:
            self.adapters.release((s.adapter_slot,))
        s.move("teardown")
        del self.seqs[s.seq_id]

    def abort(self, reason: str) -> None:
        """The device is lost (an error outside the protocol's ``StepFailed``):
        no launched step will ever commit. Every live request fails with
        ``reason`` (I7) and every resource comes back (I6)."""
        self.inflight.clear()
        for slot in self.pool.slots:
            if slot.state is not SlotState.FREE:
                slot.move("abort")
        for s in list(self.seqs.values()):
            s.inflight_refs = 0
            if s.phase is Phase.QUEUED:
                self.queue.remove(s.seq_id)
            if not s.finalized:
                self._end(s, Status.FAILED, reason)
            self._maybe_teardown(s)

    def check_integrity(self) -> None:
        """I2-I6 as bookkeeping, in any state between calls (``integrity.py``)."""
        check_integrity(self)


