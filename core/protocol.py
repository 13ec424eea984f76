"""The backend contract, stated once: what a backend is, in which order its
slots are called, which plans it runs, and what it raises otherwise.

Both backends (the simulated GPU and the CUDA one) keep this file's rules;
``tests/test_backend_contract.py`` runs the same tests against each, so the
fake certifies exactly what the real backend implements. Everything that
decides the call order lives here; a backend adds only its hardware's own
checks (the fake's simulated memory, say).

The engine calls a backend in this order for each step, one DecodeSlot per
step (slot ids 0 and 1):

    launch(slot, plan)      enqueue the forward on the compute stream (I1)
    finalize(slot, sample)  enqueue masks + sampling, record an event, and the
                            device-to-host copy on the copy stream, which waits
                            on that event only
    wait(slot)              block on that copy's event (not the device) and
                            read the slot's pinned host buffer
    release(slot)           the commit finished reading the host buffer; the
                            slot may now be launched into again (I4)

as the table ``SLOT_CALLS`` says::

    FREE ──launch──► LAUNCHED ──finalize──► FINALIZED ──wait──► WAITED ──release──► FREE
                                   │ StepFailed              │ StepFailed
                                   └──────────► FAILED ◄─────┘ ──release──► FREE

``release`` is legal only after ``wait`` (or a reported failure): the commit
must have read the slot before anything may reuse it (I4), so no backend
needs to guess whether a copy is still in flight. A launch that raises
``StepFailed`` enqueued nothing and leaves the slot FREE.

A decode row's input token is the token most recently sampled for its
``row_slot``, read on the device: the next forward never waits for the host
copy. After a row whose SamplePlan asked a value (``ValueKind``), the input is
that value's encoding instead, also on the device; the value itself lands in
``StepOutput.values`` beside the token (I13).

An IMAGE_PREFILL row writes its image prefix (``ImageRef``, encoded from its
backend-owned ``source``) at positions ``position .. position+image.length-1``,
then its prompt; a backend declares it runs them with ``Capacity.images`` and
decodes values with ``Capacity.values``. A failure of a forward, sampling or copy is ``StepFailed`` from
whichever call observes it; the engine fails that step's rows and serves on.
A call against this contract is ``ProtocolMisuse``, raised before anything
changes (h11's rule), so the backend stays usable and the state as it was.
"""

from __future__ import annotations

import enum
from itertools import chain
from typing import Container, Mapping, Protocol, TypeVar, runtime_checkable

import attrs

from bubblefree.core.values import (ImageRef, SamplePlan, SamplingParams, StepKind, StepOutput, StepPlan, ValueKind,
                                   bad_prompt_values)

NUM_SLOTS = 2


# ------------------------------------------------------------------ errors
class IllegalTransition(RuntimeError):
    """An event a state machine's table does not allow; nothing changed."""


class ProtocolMisuse(Exception):
    """A caller drove a backend against this contract: a call out of order, a
    slot that does not exist, a plan or mask the backend cannot run. Raised
    before any state changes. It is the caller's bug, never ``StepFailed``'s
    device failure; backends raise subclasses (the fake's ``HardwareMisuse``)."""


class PlanRejected(ProtocolMisuse, ValueError):
    """A StepPlan, SamplePlan or mask that breaks the contract or the capacity;
    the message names the step, the row and the field."""


@attrs.frozen
class Capacity:
    """What a backend can hold; the core's allocators are sized from it."""

    num_pages: int  # KV pages in the cache
    page_size: int  # token positions per page
    max_rows: int  # rows in one step (the largest decode batch)
    max_seqs: int  # live sequences at once (device row slots)
    max_prefill_tokens: int  # prompt tokens in one prefill step
    max_context: int  # longest sequence (prompt + output) the model takes
    num_adapter_slots: int = 0
    images: bool = False  # runs IMAGE_PREFILL steps
    values: bool = False  # has a region head: decodes the values a SamplePlan asks
    # The device runs a launched step while the host goes on (a GPU's
    # stream). False where ``launch`` computes the step before it returns
    # (torch on a CPU): nothing overlaps, so launching ahead hides no host
    # time and only adds zombies, and ``pipelined="auto"`` commits at every
    # tick (blocking's order).
    asynchronous: bool = True

    def __attrs_post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_rows", "max_seqs",
                     "max_prefill_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"Capacity.{name} must be >= 1, got {getattr(self, name)}")


# ------------------------------------------------------------- transitions
S = TypeVar("S", bound=enum.Enum)


def transition(table: Mapping[tuple[S, str], S], state: S, event: str, who: str, *,
               error: type[Exception] = IllegalTransition,
               why: Mapping[tuple[S, str], str] | None = None) -> S:
    """The state ``event`` leads to from ``state``. An event the table does not
    hold raises ``error`` naming ``who`` (and ``why[(state, event)]``, the
    hazard, when given); the caller assigns the result, so a raise changes
    nothing."""
    nxt = table.get((state, event))
    if nxt is None:
        reason = why.get((state, event)) if why else None
        raise error(f"{who}: {event!r} not allowed in {state.name}" + (f": {reason}" if reason else ""))
    return nxt


class SlotState(enum.Enum):
    """A backend slot's buffers, as far as the call order goes."""

    FREE = "free"
    LAUNCHED = "launched"  # forward enqueued
    FINALIZED = "finalized"  # sampling, event and host copy enqueued
    WAITED = "waited"  # the commit is reading the host buffer
    FAILED = "failed"  # StepFailed was reported; only release is legal


_S = SlotState
# (state, call) -> next state. A pair not in the table is a misuse.
SLOT_CALLS: dict[tuple[SlotState, str], SlotState] = {
    (_S.FREE, "launch"): _S.LAUNCHED,
    (_S.LAUNCHED, "finalize"): _S.FINALIZED,
    (_S.FINALIZED, "wait"): _S.WAITED,
    (_S.WAITED, "release"): _S.FREE,
    (_S.FAILED, "release"): _S.FREE,
}

_IN_USE = "its last step was not waited and released: launching now would overwrite its buffers (I4)"
# Every pair not in SLOT_CALLS, with the hazard real hardware would hit silently.
WHY_ILLEGAL: dict[tuple[SlotState, str], str] = {
    (_S.LAUNCHED, "launch"): _IN_USE,
    (_S.FINALIZED, "launch"): _IN_USE + "; its host copy may still be in flight",
    (_S.WAITED, "launch"): _IN_USE + "; the commit may still be reading its host buffer",
    (_S.FAILED, "launch"): "its failed step was not released",
    (_S.FREE, "finalize"): "no forward was launched into it: sampling would read stale logits",
    (_S.FINALIZED, "finalize"): "it was already finalized",
    (_S.WAITED, "finalize"): "it was already finalized",
    (_S.FAILED, "finalize"): "its step failed",
    (_S.FREE, "wait"): "its step was never finalized: no copy will ever write its host buffer",
    (_S.LAUNCHED, "wait"): "its step was never finalized: no copy will ever write its host buffer",
    (_S.WAITED, "wait"): "it was already waited",
    (_S.FAILED, "wait"): "its step failed and the failure was already reported",
    (_S.FREE, "release"): "it holds no step",
    (_S.LAUNCHED, "release"): "no commit has waited for it: its buffers are still in use (I4)",
    (_S.FINALIZED, "release"): "no commit has waited for it: its host copy may be in flight (I4)",
}


def slot_call(state: SlotState, call: str, slot: int, error: type[ProtocolMisuse] = ProtocolMisuse
              ) -> SlotState:
    """The state a backend call leads to; raises ``error``, changing nothing."""
    return transition(SLOT_CALLS, state, call, f"slot {slot}", error=error, why=WHY_ILLEGAL)


def slot_index(slot: object, error: type[ProtocolMisuse] = ProtocolMisuse) -> int:
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < NUM_SLOTS:
        raise error(f"slot must be 0 or 1, got {slot!r}")
    return slot


# ------------------------------------------------------------------- plans
def check_plan(plan: StepPlan, cap: Capacity, vocab_size: int, *,
               error: type[ProtocolMisuse] = PlanRejected) -> None:
    """Raise ``error`` naming the first field of ``plan`` the contract refuses.

    On a GPU an out-of-range page id or row slot is an out-of-bounds write into
    someone else's memory, a page shared by two rows is KV corruption, and a
    batch larger than the captured graph reads padding. Whole-plan checks use
    min/max and sets, not per-token Python loops: this runs on every launch.
    """
    def bad(why: str) -> ProtocolMisuse:
        return error(f"step {plan.step_id}: {why}")

    if not isinstance(plan, StepPlan) or not isinstance(plan.kind, StepKind):
        raise error(f"launch takes a StepPlan, got {plan!r}")
    if _plan_ok(plan, cap, vocab_size):
        return  # the common case: one pass, no messages built
    rows = plan.rows
    image_step = plan.kind is StepKind.IMAGE_PREFILL
    if image_step and not cap.images:
        raise bad("an image_prefill step on a backend without images")
    if not rows:
        raise bad("a step with no rows")
    if len(rows) > cap.max_rows:
        raise bad(f"{len(rows)} rows, the backend takes 1..{cap.max_rows}")
    for r in rows:
        if image_step and not _image_ok(r.image):
            raise bad(f"row of seq {r.seq_id}: an image_prefill row needs an ImageRef with an int "
                      f"length > 0, got {r.image!r}")
        if not image_step and r.image is not None:
            raise bad(f"row of seq {r.seq_id}: a {plan.kind.value} row carries no image")
    prefill = image_step or plan.kind is StepKind.PREFILL
    total = sum(r.num_tokens for r in rows)  # an image's prefix counts
    if prefill and total > cap.max_prefill_tokens:
        raise bad(f"{total} prefill tokens, more than max_prefill_tokens={cap.max_prefill_tokens}")
    seen_seqs: set[int] = set()
    seen_slots: set[int] = set()
    for r in rows:
        who = f"row of seq {r.seq_id}"
        if r.seq_id in seen_seqs:
            raise bad(f"seq {r.seq_id} appears twice")
        if not 0 <= r.row_slot < cap.max_seqs:
            raise bad(f"{who}: row_slot {r.row_slot} out of range [0, {cap.max_seqs})")
        if r.row_slot in seen_slots:
            raise bad(f"{who}: row_slot {r.row_slot} shared by two rows")
        if prefill and not r.tokens:
            raise bad(f"{who}: a prefill row needs its prompt tokens")
        if not prefill and r.tokens:
            raise bad(f"{who}: a decode row's input is read on the device; tokens must be ()")
        if r.tokens and (min(r.tokens) < 0 or max(r.tokens) >= vocab_size):
            raise bad(f"{who}: token ids must be in the vocabulary [0, {vocab_size})")
        end = r.position + r.num_tokens
        if r.position < 0 or end > cap.max_context:
            raise bad(f"{who}: positions {r.position}..{end - 1} outside the context of "
                      f"{cap.max_context}")
        if r.pages and (min(r.pages) < 0 or max(r.pages) >= cap.num_pages):
            raise bad(f"{who}: page ids must be in [0, {cap.num_pages}), got {r.pages}")
        if len(set(r.pages)) != len(r.pages):
            raise bad(f"{who}: a page appears twice in one page table {r.pages}")
        if len(r.pages) * cap.page_size < end:
            raise bad(f"{who}: writes position {end - 1}, beyond its {len(r.pages)} pages of "
                      f"{cap.page_size}")
        if r.adapter_slot is not None and not 0 <= r.adapter_slot < cap.num_adapter_slots:
            raise bad(f"{who}: adapter_slot {r.adapter_slot} out of range [0, {cap.num_adapter_slots})")
        if not isinstance(r.sampling, SamplingParams):
            raise bad(f"{who}: sampling must be SamplingParams")
        why = bad_prompt_values(r.prompt_values, len(r.tokens), cap.values)
        if why is not None:
            raise bad(f"{who}: prompt_values: {why}")
        seen_seqs.add(r.seq_id)
        seen_slots.add(r.row_slot)
    pages = list(chain.from_iterable(r.pages for r in rows))
    if len(set(pages)) != len(pages):
        shared = sorted({p for p in pages if pages.count(p) > 1})  # only on the error path
        raise bad(f"pages {shared} shared with another row")
    raise bad("refused by the contract's checks")  # _plan_ok and the checks above disagree


def _plan_ok(plan: StepPlan, cap: Capacity, vocab_size: int) -> bool:
    """Every check of ``check_plan`` at once, without naming the culprit: a
    valid plan costs one pass over its rows (this runs on every launch, on
    the host's share of the step). False sends ``check_plan`` through its
    row-by-row checks, which name what is wrong."""
    rows = plan.rows
    n = len(rows)
    if not 0 < n <= cap.max_rows:
        return False
    image_step = plan.kind is StepKind.IMAGE_PREFILL
    if image_step and not cap.images:
        return False
    prefill = image_step or plan.kind is StepKind.PREFILL
    total, pages = 0, []
    for r in rows:
        tokens, row_pages, image = r.tokens, r.pages, r.image
        if image_step:
            if not _image_ok(image):
                return False
            size = image.length + len(tokens)
        elif image is not None:
            return False
        else:
            size = len(tokens) or 1
        if (bool(tokens) is not prefill or r.position < 0
                or r.position + size > min(cap.max_context, len(row_pages) * cap.page_size)
                or (r.adapter_slot is not None and not 0 <= r.adapter_slot < cap.num_adapter_slots)
                or type(r.sampling) is not SamplingParams
                or (r.prompt_values and bad_prompt_values(r.prompt_values, len(tokens), cap.values))):
            return False
        if tokens:
            total += size
            if min(tokens) < 0 or max(tokens) >= vocab_size:
                return False
        pages.extend(row_pages)
    slots = {r.row_slot for r in rows}
    return (len({r.seq_id for r in rows}) == n and len(slots) == n
            and min(slots) >= 0 and max(slots) < cap.max_seqs
            and (not prefill or total <= cap.max_prefill_tokens)
            and (not pages or (min(pages) >= 0 and max(pages) < cap.num_pages))
            and len(set(pages)) == len(pages))


def _image_ok(image: object) -> bool:
    return (isinstance(image, ImageRef) and type(image.length) is int  # a bool is not a length
            and image.length > 0)


def check_sample(sample: SamplePlan, plan: StepPlan, known_masks: Container[int], *,
                 values: bool = False, error: type[ProtocolMisuse] = PlanRejected) -> None:
    """A SamplePlan must name the launched step, one mask per row, only masks
    ``register_mask`` returned, and ``values`` () or one ``ValueKind`` or None
    per row; a kind only where the backend has a region head (``values``,
    its ``Capacity.values``)."""
    if not isinstance(sample, SamplePlan):
        raise error(f"finalize takes a SamplePlan, got {sample!r}")
    if sample.step_id != plan.step_id:
        raise error(f"finalize of step {sample.step_id} into a slot holding step {plan.step_id}")
    if len(sample.mask_ids) != len(plan.rows):
        raise error(f"step {plan.step_id}: {len(sample.mask_ids)} mask ids for {len(plan.rows)} rows")
    for mask_id in sample.mask_ids:
        if mask_id is not None and mask_id not in known_masks:
            raise error(f"step {plan.step_id}: mask id {mask_id!r} was never registered")
    kinds = sample.values
    if kinds == ():
        return
    if type(kinds) is not tuple or len(kinds) != len(plan.rows):
        raise error(f"step {plan.step_id}: values must be () or one entry per row ({len(plan.rows)}), "
                    f"got {kinds!r}")
    for kind in kinds:
        if kind is not None and not isinstance(kind, ValueKind):
            raise error(f"step {plan.step_id}: values entries must be a ValueKind or None, got {kind!r}")
        if kind is not None and not values:
            raise error(f"step {plan.step_id}: a {kind.value} value asked of a backend without a region head")


def check_mask(allowed: frozenset[int], vocab_size: int) -> frozenset[int]:
    """The allowed-token set ``register_mask`` stores; raises ``PlanRejected``."""
    allowed = frozenset(allowed)
    if not allowed:
        raise PlanRejected("register_mask: an empty allowed-token set can never be sampled")
    bad = [t for t in allowed if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise PlanRejected(f"register_mask: tokens {sorted(bad, key=repr)[:5]} are outside the "
                           f"vocabulary [0, {vocab_size})")
    return allowed


# ---------------------------------------------------------------- protocol
@runtime_checkable
class Backend(Protocol):
    """Executes steps in two DecodeSlots (slot ids 0 and 1), in the order
    ``SLOT_CALLS`` allows."""

    @property
    def capacity(self) -> Capacity: ...

    @property
    def vocab_size(self) -> int: ...

    def register_mask(self, allowed: frozenset[int]) -> int:
        """Store an allowed-token set once, off the hot path; return its id."""
        ...

    def launch(self, slot: int, plan: StepPlan) -> None: ...

    def finalize(self, slot: int, sample: SamplePlan) -> None: ...

    def wait(self, slot: int) -> StepOutput: ...

    def release(self, slot: int) -> None: ...
