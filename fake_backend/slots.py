"""The device side of a DecodeSlot: its buffers and where it stands in the
call order.

The call order is the contract's (``core.protocol.SLOT_CALLS``), the same
table the CUDA backend keeps; every call outside it is the misuse named in
``core.protocol.WHY_ILLEGAL`` (the hazard real hardware would silently hit),
raised here as ``HardwareMisuse`` before any state changes.
"""

from __future__ import annotations

import attrs

from bubblefree.core.protocol import SlotState, slot_call
from bubblefree.core.values import StepOutput, StepPlan
from bubblefree.fake_backend.errors import HardwareMisuse
from bubblefree.fake_backend.kv import Context
from bubblefree.fake_backend.timing import Fault

__all__ = ["Slot", "SlotState"]


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
        return slot_call(self.state, call, self.index, HardwareMisuse)

    def clear(self) -> None:
        self.state = SlotState.FREE
        self.plan, self.contexts, self.fault, self.host_buffer = None, (), None, None
