"""The device side of a DecodeSlot: its buffers' lifecycle, as a table.

::

    FREE ──launch──► LAUNCHED ──finalize──► FINALIZED ──wait──► WAITED ──release──► FREE
                                   │ (fault)                 │ (fault)
                                   └──────────► FAILED ◄─────┘ ──release──► FREE

A launch fault enqueues nothing, so the slot stays FREE. Every call not in
the table is the misuse named in ``WHY_ILLEGAL`` (the hazard real hardware
would silently hit), raised before any state changes.
"""

from __future__ import annotations

import enum

import attrs

from bubblefree.core.values import StepOutput, StepPlan
from bubblefree.fake_backend.errors import HardwareMisuse
from bubblefree.fake_backend.kv import Context
from bubblefree.fake_backend.timing import Fault


class SlotState(enum.Enum):
    FREE = "free"
    LAUNCHED = "launched"  # forward enqueued
    FINALIZED = "finalized"  # sampling, event and host copy enqueued
    WAITED = "waited"  # the commit is reading the host buffer
    FAILED = "failed"  # a fault was reported; the engine still releases it


S = SlotState
TRANSITIONS: dict[tuple[str, SlotState], SlotState] = {
    ("launch", S.FREE): S.LAUNCHED,
    ("finalize", S.LAUNCHED): S.FINALIZED,
    ("wait", S.FINALIZED): S.WAITED,
    ("release", S.WAITED): S.FREE,
    ("release", S.FAILED): S.FREE,
}

_IN_USE = "its last step was not waited and released: launching now would overwrite its buffers (I4)"
WHY_ILLEGAL: dict[tuple[str, SlotState], str] = {
    ("launch", S.LAUNCHED): _IN_USE,
    ("launch", S.FINALIZED): _IN_USE + "; its host copy may still be in flight",
    ("launch", S.WAITED): _IN_USE + "; the commit may still be reading its host buffer",
    ("launch", S.FAILED): "its failed step was not released",
    ("finalize", S.FREE): "no forward was launched into it: sampling would read stale logits",
    ("finalize", S.FINALIZED): "it was already finalized",
    ("finalize", S.WAITED): "it was already finalized",
    ("finalize", S.FAILED): "its step failed",
    ("wait", S.FREE): "its step was never finalized: no copy will ever write its host buffer",
    ("wait", S.LAUNCHED): "its step was never finalized: no copy will ever write its host buffer",
    ("wait", S.WAITED): "it was already waited",
    ("wait", S.FAILED): "its step failed and the failure was already reported",
    ("release", S.FREE): "it holds no step",
    ("release", S.LAUNCHED): "no commit has waited for it: its buffers are still in use (I4)",
    ("release", S.FINALIZED): "no commit has waited for it: its host copy may be in flight (I4)",
}


@attrs.define
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    plan: StepPlan | None = None
    contexts: tuple[Context, ...] = ()
    fault: Fault | None = None  # a sampling or copy fault that wait will report
    copy_end: float = 0.0
    host_buffer: StepOutput | None = None  # written only when the copy lands

    def check(self, call: str) -> SlotState:
        """The state ``call`` leads to; raises, changing nothing, if illegal."""
        nxt = TRANSITIONS.get((call, self.state))
        if nxt is None:
            raise HardwareMisuse(f"{call} on slot {self.index} ({self.state.name}): "
                                 f"{WHY_ILLEGAL[(call, self.state)]}")
        return nxt

    def clear(self) -> None:
        self.state = SlotState.FREE
        self.plan, self.contexts, self.fault, self.host_buffer = None, (), None, None
