"""DecodeSlots: the preallocated working set of one in-flight step.

Two slots let the host commit one step while the device runs the other
(seed). Each slot holds its own host staging (pinned on CUDA, so copies to
the device never wait), its own logits, sampled ids and sampling inputs on
the device, a pinned host landing buffer, and two events:

- ``sampled`` is recorded on the compute stream right after the step's
  sampling wrote ``sampled``; the slot's device-to-host copy runs on the copy
  stream after waiting on exactly this event, not on the stream, so it never
  waits for work queued behind its step.
- ``copied`` is recorded on the copy stream after that copy; ``wait`` blocks
  on it alone.

I4: the slot's staging and landing buffers are reused only after
``release``, which the contract allows only once ``wait`` has blocked on
``copied`` (or a failure was reported), so no transfer can still be in
flight into a released slot. The call order is the contract's table
(``core.protocol.SLOT_CALLS``); calls out of order raise ``ProtocolMisuse``
and leave the slot unchanged.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from bubblefree.core.protocol import SlotState, slot_call
from bubblefree.core.values import StepPlan
from bubblefree.cuda_backend.sampling import PARTS

__all__ = ["DecodeSlot", "SlotState", "make_slot"]


@attrs.define(eq=False)
class DecodeSlot:
    index: int
    staging: torch.Tensor  # [staging_size] int64 host (pinned on CUDA): launch metadata
    staging_np: np.ndarray  # numpy view of ``staging``: packing without torch per-element calls
    sample_staging: torch.Tensor  # [PARTS * max_rows] int64 host (pinned): sampling inputs
    sample_np: np.ndarray
    sample_inputs: torch.Tensor  # [PARTS * max_rows] int64 device: the sampling graphs' input
    logits: torch.Tensor  # [max_rows, V] float32 device
    sampled: torch.Tensor  # [max_rows] int64 device
    landing: torch.Tensor  # [max_rows] int64 host (pinned): where the copy lands
    sampled_event: torch.cuda.Event | None
    copied_event: torch.cuda.Event | None
    state: SlotState = SlotState.FREE
    plan: StepPlan | None = None
    bucket: int = 0  # padded row count the step runs at
    # The launched step sampled ahead in its forward, and those tokens may
    # stand (the backend clears this where another step's launch undid them).
    ahead: bool = False
    # (slot buffer, forward output) copies not yet enqueued: a step that
    # sampled ahead may never need them (CudaBackend._defer).
    pending: list = attrs.Factory(list)

    def advance(self, call: str) -> None:
        self.state = slot_call(self.state, call, self.index)

    def check(self, call: str) -> None:
        """Raise if ``call`` is illegal now, without changing anything."""
        slot_call(self.state, call, self.index)


def make_slot(index: int, *, staging_size: int, max_rows: int, vocab_size: int,
              device: torch.device, sampled: torch.Tensor | None = None) -> DecodeSlot:
    """``sampled``: the slot's ``[max_rows]`` row of a buffer the backend
    shares between slots (a forward's graph writes it by slot index), or
    None for a buffer of its own."""
    cuda = device.type == "cuda"

    def host(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.long, pin_memory=cuda)

    staging, sample_staging = host(staging_size), host(PARTS * max_rows)
    return DecodeSlot(
        index=index,
        staging=staging, staging_np=staging.numpy(),
        sample_staging=sample_staging, sample_np=sample_staging.numpy(),
        sample_inputs=torch.zeros(PARTS * max_rows, dtype=torch.long, device=device),
        logits=torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device),
        sampled=torch.zeros(max_rows, dtype=torch.long, device=device) if sampled is None
        else sampled,
        landing=host(max_rows),
        sampled_event=torch.cuda.Event() if cuda else None,
        copied_event=torch.cuda.Event() if cuda else None,
    )
