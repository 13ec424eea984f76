"""A decode step's inputs as one kernel (Triton, CUDA).

Before its first layer a decode step gathers each row's input (the
embedding of the token its sequence sampled last, or on moondream a value's
encoding where the row's flag is set), the KV slot its new key goes to
(through the row's page table), and the rotary cos and sin at its
position. In torch that is about twenty small kernels inside the graph
(index selects, the gather, the slot arithmetic, and the rotary module's
matmul, concatenation, cos, sin, scaling and casts): about 40 us of a
moondream2 step on the H200 (docs/performance.md). Here one program per
row does all of it, reading cos and sin from tables the model's own rotary
module computed once for every position (``RopeTable``), so they are its
values bit for bit.

Where the step's layers run as dependent launches (``pdl``), the kernel
lets the first of them launch as it starts (``pdl.release``): that one
reads its weights while the rows' inputs are gathered, and waits for them
(``pdl.enter``) before it reads any. The kernel itself is a graph's first
and waits for nothing.

``torch_step_inputs`` is the same in torch: the reference, and what runs
where Triton does not.
"""

from __future__ import annotations

import attrs
import torch

from bubblefree.cuda_backend.pdl import release, tl, triton


@attrs.frozen
class RopeTable:
    """cos and sin ``[positions, rot]`` in the model's dtype, as its rotary
    module gives them for each position (scaling included)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, rotary: torch.nn.Module, positions: int, dtype: torch.dtype,
           device: torch.device) -> "RopeTable":
        x = torch.zeros(1, dtype=dtype, device=device)  # the module reads only its dtype
        with torch.no_grad():
            cos, sin = rotary(x, torch.arange(positions, device=device).view(1, -1))
        return cls(cos[0].contiguous(), sin[0].contiguous())

    def __len__(self) -> int:
        return self.cos.shape[0]


@attrs.frozen
class StepInputs:
    x: torch.Tensor  # [B, D] the rows' input embeddings
    slot_mapping: torch.Tensor  # [B] flat KV slot of each row's new key
    cos: torch.Tensor  # [B, rot]
    sin: torch.Tensor  # [B, rot]


if triton is not None:

    @triton.jit
    def _inputs_kernel(rows_ptr, pos_ptr, pt_ptr, last_ptr, emb_ptr, flag_ptr, val_ptr,
                       cos_t_ptr, sin_t_ptr, x_ptr, slot_ptr, cos_ptr, sin_ptr,
                       D, R, P, PS, se_v, sv_s, sx_b, sct_p, sc_b,
                       VALUES: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       PDL: tl.constexpr):
        release(PDL)
        r = tl.program_id(0)
        seq = tl.load(rows_ptr + r)
        pos = tl.load(pos_ptr + r)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        tok = tl.load(last_ptr + seq)
        x = tl.load(emb_ptr + tok * se_v + d, mask=dm)
        if VALUES:
            flag = tl.load(flag_ptr + seq)
            v = tl.load(val_ptr + seq * sv_s + d, mask=dm)
            x = tl.where(flag != 0, v, x)
        tl.store(x_ptr + r * sx_b + d, x, mask=dm)
        page = tl.load(pt_ptr + r * P + pos // PS)
        tl.store(slot_ptr + r, page * PS + pos % PS)
        j = tl.arange(0, BLOCK_R)
        jm = j < R
        tl.store(cos_ptr + r * sc_b + j, tl.load(cos_t_ptr + pos * sct_p + j, mask=jm), mask=jm)
        tl.store(sin_ptr + r * sc_b + j, tl.load(sin_t_ptr + pos * sct_p + j, mask=jm), mask=jm)


def torch_step_inputs(row_slots: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                      last_token: torch.Tensor, embed: torch.Tensor, rope: RopeTable,
                      page_size: int, flags: torch.Tensor | None = None,
                      values: torch.Tensor | None = None) -> StepInputs:
    """Rows ``[B]`` (row slots), their positions ``[B]`` and page tables
    ``[B, P]``: the embedding ``embed`` ``[V, D]`` of ``last_token`` at each
    row slot (or, where ``flags`` is set at the row slot, ``values`` there),
    the new key's KV slot, and the rope tables' rows at the positions."""
    x = embed.index_select(0, last_token.index_select(0, row_slots))  # [B, D]
    if flags is not None:
        x = torch.where(flags.index_select(0, row_slots).unsqueeze(1),
                        values.index_select(0, row_slots), x)
    page = page_table.gather(1, (positions // page_size).unsqueeze(1)).squeeze(1)  # [B]
    return StepInputs(x, page * page_size + positions % page_size,
                      rope.cos.index_select(0, positions), rope.sin.index_select(0, positions))


def step_inputs(row_slots: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                last_token: torch.Tensor, embed: torch.Tensor, rope: RopeTable, page_size: int,
                flags: torch.Tensor | None = None,
                values: torch.Tensor | None = None, pdl: bool = False) -> StepInputs:
    """``torch_step_inputs``' contract, in one launch where Triton runs;
    ``pdl``: the kernel after it is launched dependent and may launch as
    this one starts (the module's doc)."""
    if triton is None or embed.device.type != "cuda":
        return torch_step_inputs(row_slots, positions, page_table, last_token, embed, rope,
                                 page_size, flags, values)
    b, d = row_slots.shape[0], embed.shape[1]
    rot = rope.cos.shape[1]
    x = embed.new_empty(b, d)
    slots = positions.new_empty(b)
    cos, sin = rope.cos.new_empty(b, rot), rope.sin.new_empty(b, rot)
    has_values = flags is not None
    _inputs_kernel[(b,)](
        row_slots, positions, page_table, last_token, embed,
        flags.view(torch.uint8) if has_values else row_slots, values if has_values else embed,
        rope.cos, rope.sin, x, slots, cos, sin,
        d, rot, page_table.stride(0), page_size, embed.stride(0),
        values.stride(0) if has_values else 0, x.stride(0), rope.cos.stride(0), cos.stride(0),
        VALUES=has_values, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=triton.next_power_of_2(rot),
        PDL=pdl, num_warps=4)
    return StepInputs(x, slots, cos, sin)
