"""A fused decode step's attention as one op: rotary embeddings on the
projection's raw q and k, the step's key and value written into the cache,
and paged attention over each row's pages.

Run as separate steps, a compiled layer launched two small kernels before
attention (rotary on q; rotary on k with the KV write), and for Phi one
after it (GELU of fc1 with the concatenation its output GEMM reads): each a
few microseconds of launch and tail at decode sizes, 72 per step for a
24-layer model. On CUDA the attention kernels do all three
(``paged_decode.NewToken``, ``paged_decode.Activation``): every program
rotates its query, the step's own key and value come from registers, the
first query head of each KV group writes them, and each row's programs
apply the activation to a share of fc1's columns. Elsewhere the same steps
run in torch, with the kernels' semantics and precision (rotary in float32,
the key rounded to the cache's dtype before it is attended).

The op mutates ``kv``, one layer's ``[2, tokens, KVH, D]`` cache: a single
tensor, so torch.compile writes it in place. Separate key and value views of
one storage would make it copy the layer's whole cache every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend import paged_decode
from bubblefree.cuda_backend.add_norm import sum_slices
from bubblefree.cuda_backend.attention import _decode_attention, _gather, row_keys, store_kv
from bubblefree.cuda_backend.kernel_config import Dispatch

# MLP activations the kernels apply (transformers' hidden_act names): 1 the
# tanh form of GELU, 2 the erf form. See ``rope_attend``'s ``mlp``.
ACTIVATIONS = {"gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu_python_tanh": 1, "gelu": 2,
               "gelu_python": 2}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding on the first ``cos.shape[-1]`` dims of
    ``x`` ``[..., D]``; the rest pass through (partial rotary). In x's dtype."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos + rotated * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot


def rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, slot: torch.Tensor,
                page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                scaling: float | None, window: int | None, mlp: torch.Tensor | None = None,
                act: int = 0, *, dispatch: Dispatch, pdl: bool = False,
                counters: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """One decode query per row. q ``[B, H, D]``, k and v ``[B, KVH, D]``
    before rotary; cos, sin ``[B, ROT]``; kv the layer's cache ``[2, N *
    page_size, KVH, D]``, written at ``slot`` ``[B]``; page table ``[B, P]``;
    positions ``[B]`` (the query's, and the new key's). Returns ``[B, H, Dv]``
    in q's dtype. ``dispatch`` picks the attention kernel on CUDA; ``pdl``
    launches it dependent on the kernel before (``cuda_backend.pdl``);
    ``counters`` (int32, zero, one per (row, head) at least): the split
    kernel's last programs combine (``paged_decode.split_attention``).

    Every row is its own sequence: it sees the cache as it was before the
    op, plus its own new key. Rows never see each other's (the token rows of
    one prompt must write first and attend after: ``attention.store_kv``,
    then ``paged_decode``).

    With ``mlp`` ``[B, I]`` (a parallel block's fc1 output) the result is
    ``[B, H * Dv + I]``: the attention, then ``ACTIVATIONS`` kind ``act`` of
    ``mlp``, the input of a GEMM over both (Phi's dense and fc2, fused).

    q, k and v may instead be ``[S, B, *, D]`` float32: S slices of the
    projection's partial sums, one stride apart in one buffer (the bias in
    one of them), which the kernels add and round to ``dtype`` (the
    projection's output dtype, and the result's), with no kernel before
    them to add the slices (no ``mlp`` then)."""
    sliced = q.dim() == 4
    if sliced:
        if (k.dim() != 4 or v.dim() != 4 or mlp is not None
                or dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or {q.dtype, k.dtype, v.dtype} != {torch.float32}
                or len({q.shape[0], k.shape[0], v.shape[0]}) != 1
                or len({q.stride(0), k.stride(0), v.stride(0)}) != 1):
            raise ValueError("rope_attend: slices of sums are float32 q, k and v [S, B, *, D] "
                             "of one buffer, with a dtype to round to and no mlp")
    whole = (q, k, v)
    if sliced:
        q, k, v = q[0], k[0], v[0]
    named = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin, "kv": kv}
    if mlp is not None:
        named["mlp"] = mlp
        if mlp.dim() != 2 or mlp.shape[0] != q.shape[0] or act not in (1, 2):
            raise ValueError(f"rope_attend: mlp {tuple(mlp.shape)} must be [{q.shape[0]}, I] "
                             f"with act 1 (tanh GELU) or 2 (erf GELU), not {act}")
    for name, t in named.items():
        if t.stride(-1) != 1:
            raise ValueError(f"rope_attend: {name}'s last dimension must be contiguous")
    b, h, d = q.shape
    if k.shape != (b, kv.shape[2], d) or v.shape != (b, kv.shape[2], kv.shape[3]):
        raise ValueError(f"rope_attend: k {tuple(k.shape)} and v {tuple(v.shape)} do not match "
                         f"{b} rows of the cache's heads {tuple(kv.shape[2:])}")
    if cos.shape != sin.shape or cos.shape[0] != b or cos.shape[1] > d or cos.shape[1] % 2:
        raise ValueError(f"rope_attend: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must "
                         f"be [{b}, ROT] with ROT even and at most {d}")
    rows = {"slot": slot.shape, "positions": positions.shape, "page_table": page_table.shape[:1]}
    for name, shape in rows.items():
        if tuple(shape) != (b,):
            raise ValueError(f"rope_attend: {name} {tuple(shape)} must have one entry per row "
                             f"({b})")
    scale = scaling if scaling is not None else d ** -0.5
    return _rope_attend(*whole, cos, sin, kv, slot, page_table, positions, page_size,
                        float(scale), int(window) if window is not None else paged_decode.NO_WINDOW,
                        mlp, act if mlp is not None else 0, dispatch.scalars(), pdl, counters,
                        dtype if sliced else q.dtype)


# Takes the dispatch as integers (Dispatch.scalars), as paged_decode's op does.
# No argument has a default: torch 2.11 drops trailing arguments equal to
# their defaults before it bumps the mutated ones' versions, so a defaulted
# ``counters=None`` raised IndexError in every eager call.
@torch.library.custom_op("bubblefree::rope_attend", mutates_args=("kv", "counters"))
def _rope_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, kv: torch.Tensor, slot: torch.Tensor,
                 page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                 scale: float, window: int, mlp: torch.Tensor | None,
                 act: int, dispatch: list[int], pdl: bool,
                 counters: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    # [S, B, *, D] slices of sums (rope_attend): the kernels add them; elsewhere
    # they are added here first.
    slices, stride = (q.shape[0], q.stride(0)) if q.dim() == 4 else (1, 0)
    if q.dim() == 4 and (slices == 1 or not paged_decode.available(q)):
        q, k, v = (sum_slices(t).to(dtype) for t in (q, k, v))
        slices = 1
    elif q.dim() == 4:
        q, k, v = q[0], k[0], v[0]
    b, h, _ = q.shape
    dv = kv.shape[3]
    if not paged_decode.available(q):
        out = _portable(q, k, v, cos, sin, kv, slot, page_table, positions, page_size, scale,
                        window)
        if mlp is None:
            return out
        return torch.cat((out.reshape(b, -1), _torch_act(mlp, act).to(q.dtype)), dim=-1)
    new = paged_decode.NewToken(k, v, cos, sin, slot, slices, stride, dtype)
    chosen = Dispatch.from_scalars(dispatch)
    if mlp is None:
        return paged_decode.run(q, kv[0], kv[1], page_table, positions, page_size, scale,
                                window, chosen, new=new, pdl=pdl, counters=counters)
    row = q.new_empty((b, h * dv + mlp.shape[1]))  # [attention | act(mlp)]
    attention = row[:, :h * dv].view(b, h, dv)
    rider = paged_decode.Activation(mlp, row[:, h * dv:], act)
    paged_decode.run(q, kv[0], kv[1], page_table, positions, page_size, scale, window, chosen,
                     new=new, out=attention, act=rider, pdl=pdl, counters=counters)
    return row


@_rope_attend.register_fake
def _(q, k, v, cos, sin, kv, slot, page_table, positions, page_size, scale, window, mlp, act,
      dispatch, pdl, counters, dtype):
    b, h = q.shape[-3], q.shape[-2]
    if mlp is None:
        return q.new_empty((b, h, kv.shape[3]), dtype=dtype)
    return q.new_empty((b, h * kv.shape[3] + mlp.shape[1]), dtype=dtype)


def _torch_act(x: torch.Tensor, act: int) -> torch.Tensor:
    """``ACTIVATIONS`` kind ``act`` in float32, as the kernels compute it."""
    return F.gelu(x.float(), approximate="tanh" if act == 1 else "none")


def _portable(q, k, v, cos, sin, kv, slot, page_table, positions, page_size: int, scale: float,
              window: int) -> torch.Tensor:
    """The op in torch, with the kernels' semantics: each row attends to the
    cache as it was before the step, plus its own new key at its position."""
    keys, values = kv[0], kv[1]
    cos, sin = cos[:, None].float(), sin[:, None].float()  # over heads
    q = rotate(q.float(), cos, sin).to(q.dtype)
    k = rotate(k.float(), cos, sin).to(keys.dtype)
    v = v.to(values.dtype)
    kv_index, key_pos = row_keys(page_table, page_size)
    pos = positions.unsqueeze(1)
    mask = (key_pos <= pos) & (key_pos > pos - window)
    k_all, v_all = _gather(keys, values, kv_index, q.dtype)  # copies: the cache before
    own = torch.arange(q.shape[0], device=q.device)
    k_all[own, positions], v_all[own, positions] = k.to(q.dtype), v.to(q.dtype)
    store_kv(keys, values, slot, k, v)
    return _decode_attention(q, k_all, v_all, mask, scale)
