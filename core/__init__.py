"""bubblefree's core: the pipelined-decoding state machine, free of torch.

Everything that decides what runs, when, and what is committed lives here.

The bubble, and why the tick is split (the seed)::

    blocking   GPU  [fwd t][smp t]......................[fwd t+1][smp t+1]....
               CPU                 [wait][commit t][plan]
    pipelined  GPU  [fwd t][smp t][fwd t+1]......[smp t+1][fwd t+2]...
               CPU        [launch t+1][wait][commit t][finalize t+1][launch t+2]

Glossary. "finalize" names two things, both from the seed: the *finalize
phase* of a tick (masks, sampling and the host copy enqueued for the newest
step; ``SlotState.FINALIZED``, ``Scheduler.finalized``), and a *finalized
sequence* (its request has ended; ``Phase.FINALIZED``, ``Sequence.finalized``).
A finalized sequence that a launched step still includes is a *zombie*.

Where things are: ``scheduler.py`` keeps the invariants (DESIGN.md I2-I9; I13, a decoded value only where asked, and I14, a decode state one live request's, are ours: DESIGN.md keeps I11-I12 for a prefix cache),
``policy.py`` chooses each step's rows, ``integrity.py`` checks,
``events.py`` is what the scheduler reports, ``engine.py`` drives a backend
(``protocol.py``: the backend contract, stated once) and delivers results to
callers; ``ahead.py`` is auto's per-tick choice to launch ahead or not, and
``ahead_measures.py`` what that choice weighs, measured.
"""

from bubblefree.core.protocol import Backend, Capacity
from bubblefree.core.decode_state import DecodeState
from bubblefree.core.engine import Engine
from bubblefree.core.handle import Handle
from bubblefree.core.pages import DoubleRelease, IdPool, pages_needed
from bubblefree.core.scheduler import InvariantViolation, Scheduler
from bubblefree.core.sequence import IllegalTransition, Phase, Sequence
from bubblefree.core.slots import DecodeSlot, SlotPool, SlotState, Step
from bubblefree.core.values import (
    GREEDY, ImageRef, InvalidRequest, PromptValue, Request, Result, SamplePlan, SamplingParams, Status,
    StepFailed, StepKind, StepOutput, StepPlan, StepRow, ValueKind,
)

__all__ = [
    "Backend", "Capacity", "DecodeSlot", "DecodeState", "DoubleRelease", "Engine", "GREEDY",
    "Handle", "IdPool", "ImageRef", "IllegalTransition", "InvalidRequest", "InvariantViolation", "Phase",
    "PromptValue", "Request", "Result", "SamplePlan", "SamplingParams", "Scheduler", "Sequence", "SlotPool",
    "SlotState", "Status", "Step", "StepFailed", "StepKind", "StepOutput", "StepPlan", "StepRow",
    "ValueKind", "pages_needed",
]
