"""The protocol every backend satisfies: the simulated GPU and the CUDA one.

A backend executes plans and reports results; it decides nothing (DESIGN.md).
The engine calls it in this order for each step, one DecodeSlot per step:

    launch(slot, plan)      enqueue the forward on the compute stream (I1)
    finalize(slot, sample)  enqueue masks + sampling, record an event, and the
                            device-to-host copy on the copy stream, which waits
                            on that event only
    wait(slot)              block on that copy's event (not the device) and
                            read the slot's pinned host buffer
    release(slot)           the commit finished reading the host buffer; the
                            slot may now be launched into again (I4)

A decode row's input token is the token most recently sampled for its
``row_slot``, read on the device: the next forward never waits for the host
copy. A failure of a forward, sampling or copy is raised as ``StepFailed``
from whichever call observes it; the engine fails that step's rows.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from bubblefree.core.values import SamplePlan, StepOutput, StepPlan


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

    def __attrs_post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_rows", "max_seqs",
                     "max_prefill_tokens", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(f"Capacity.{name} must be >= 1, got {getattr(self, name)}")


@runtime_checkable
class Backend(Protocol):
    """Executes steps in two DecodeSlots (slot ids 0 and 1)."""

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
