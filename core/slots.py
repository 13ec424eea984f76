"""The two DecodeSlots and the steps that occupy them.

A DecodeSlot is the backend's bundle of preallocated buffers for one step:
staging, logits, sampled ids, and a pinned host landing buffer. The core
tracks only whose turn it is::

    FREE ──launch──► LAUNCHED ──finalize──► FINALIZED ──release──► FREE
      ▲                  │                      │
      └──────abort───────┴─────────abort────────┘

``release`` happens when the commit that reads the slot has *finished*, not
when the GPU is done with it: the host buffer is the landing site of a copy
that may still be in flight (I4). With exactly two slots at most two steps
are in flight, which is what bounds ``inflight_refs`` by 2 (I3).

``abort`` is for a lost device only: no launched step will ever commit, so
its slot is free again without a release. Naming it in the table keeps even
that path a move the table allows. The backend's own, finer table (with
``wait`` and failures) is ``core.protocol.SLOT_CALLS``.
"""

from __future__ import annotations

import enum

import attrs

from bubblefree.core.protocol import NUM_SLOTS, transition
from bubblefree.core.values import StepKind, ValueKind


class SlotState(enum.Enum):
    FREE = "free"
    LAUNCHED = "launched"  # forward enqueued, sampling not yet
    FINALIZED = "finalized"  # sampling and host copy enqueued; awaiting commit


SLOT_TRANSITIONS: dict[tuple[SlotState, str], SlotState] = {
    (SlotState.FREE, "launch"): SlotState.LAUNCHED,
    (SlotState.LAUNCHED, "finalize"): SlotState.FINALIZED,
    (SlotState.FINALIZED, "release"): SlotState.FREE,
    # A lost device: no launched step will ever commit (``Scheduler.abort``).
    (SlotState.LAUNCHED, "abort"): SlotState.FREE,
    (SlotState.FINALIZED, "abort"): SlotState.FREE,
}


@attrs.define(eq=False)
class Step:
    """One launched step: which sequences it includes, in row order."""

    step_id: int
    kind: StepKind
    slot: int
    seq_ids: tuple[int, ...]
    mask_ids: tuple[int | None, ...] = ()  # set at finalize, checked at commit (I9)
    value_kinds: tuple[ValueKind | None, ...] = ()  # set at finalize, () if none asked (I13)
    failed: str | None = None  # a backend fault seen at finalize


@attrs.define(eq=False)
class DecodeSlot:
    index: int
    state: SlotState = SlotState.FREE

    def move(self, event: str) -> None:
        self.state = transition(SLOT_TRANSITIONS, self.state, event, f"DecodeSlot {self.index}")


@attrs.define
class SlotPool:
    slots: tuple[DecodeSlot, ...] = attrs.Factory(
        lambda: tuple(DecodeSlot(i) for i in range(NUM_SLOTS)))

    def free_slot(self) -> DecodeSlot | None:
        for slot in self.slots:
            if slot.state is SlotState.FREE:
                return slot
        return None

    def busy(self) -> int:
        return sum(s.state is not SlotState.FREE for s in self.slots)
