"""bubblefree's core: the pipelined-decoding state machine, free of torch.

Everything that decides what runs, when, and what is committed lives here.
"""

from bubblefree.core.protocol import Backend, Capacity
from bubblefree.core.decode_state import DecodeState
from bubblefree.core.engine import Engine, Handle
from bubblefree.core.pages import DoubleRelease, IdPool, pages_needed
from bubblefree.core.scheduler import InvariantViolation, Scheduler
from bubblefree.core.sequence import IllegalTransition, Phase, Sequence
from bubblefree.core.slots import DecodeSlot, SlotPool, SlotState, Step
from bubblefree.core.values import (
    GREEDY, InvalidRequest, Request, Result, SamplePlan, SamplingParams, Status, StepFailed,
    StepKind, StepOutput, StepPlan, StepRow,
)

__all__ = [
    "Backend", "Capacity", "DecodeSlot", "DecodeState", "DoubleRelease", "Engine", "GREEDY",
    "Handle", "IdPool", "IllegalTransition", "InvalidRequest", "InvariantViolation", "Phase",
    "Request", "Result", "SamplePlan", "SamplingParams", "Scheduler", "Sequence", "SlotPool",
    "SlotState", "Status", "Step", "StepFailed", "StepKind", "StepOutput", "StepPlan", "StepRow",
    "pages_needed",
]
