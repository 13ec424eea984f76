"""The fused decode step with every kernel ours, each launched dependent on
the one before (``cuda_backend.pdl``).

At one row a decode step's kernels are short (a 2 MB projection takes 4 µs,
most of it the launch, the first reads' latency and the tail), so what sets
the step's time is how many kernels run one after the other and how long
each takes to get going. Here:

- every GEMM is ``skinny_gemm``'s kernel, which reads its first weights
  before the previous kernel has ended;
- an output projection (Phi's fused dense + fc2; Llama's and Qwen2's o_proj
  and down_proj) leaves its partial sums to the next norm (``add_norm``):
  no reduction kernel, no separate residual add;
- Llama's and Qwen2's gate and up projection writes ``silu(gate) * up``
  itself (``skinny_gemm``'s GLU: each program owns the same columns of
  both), so the down projection reads it as is;
- the attention kernels (rotary, the KV write, and Phi's activation inside
  them) launch dependent too, and add Llama's and Qwen2's q, k, v where
  that projection leaves slices of sums; in buckets of up to
  ``KernelConfig.last_combines`` rows the split kernel's last programs
  combine its states, without a second kernel.

A Phi layer is four kernels (five with the split attention kernel at few
rows); a Llama or Qwen2 layer six (seven). The layer functions take and
return the residual stream as ``(x, delta)``, ``delta`` being the last
projection's float32 partial sums ``[S, M, N]`` (bias included).
``FusedDecoder`` runs them for decode buckets of at most
``KernelConfig.pdl_rows`` rows, on CUDA devices that support it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend import skinny_gemm
from bubblefree.cuda_backend.add_norm import add_norm, torch_add
from bubblefree.cuda_backend.kernel_config import step_tile
from bubblefree.cuda_backend.rope_attention import rope_attend


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dims, *,
         partial: bool = False, glu: bool = False) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through our kernel, launched dependent:
    ``[M, N]`` in x's dtype, or with ``partial`` float32 partial sums ``[S,
    M, N]``, the bias in the first. ``glu``: w is ``[gate; up]`` and the
    output ``silu(gate) * up``, ``[M, N / 2]``. The tile: ``dims.pdl_tiles``'
    where it has one for this shape and row count, else ``step_tile``'s
    (K whole where the output is not partial sums). Without Triton on x's
    device (or whole steps of K): torch's, the same results, plainly
    launched (still ordered)."""
    rows, k, n = x.shape[0], w.shape[1], w.shape[0]
    tile = dims.pdl_tiles.tile_for(rows, k, n)
    if tile is None or not tile.fits(k) or (glu and tile.split > 1):
        tile = step_tile(k, n // 2 if glu else n, rows, partial, dims.sms)
    if tile is None or not skinny_gemm.available(x):
        out = F.linear(x, w, bias)
        if glu:
            gate, up = out.chunk(2, dim=-1)
            out = F.silu(gate) * up
        return out.float().unsqueeze(0) if partial else out
    if partial:
        return skinny_gemm.launch(x, w, bias, tile, bias_in_parts=True, pdl=True, partial=True)
    if glu:
        return skinny_gemm.launch(x, w, bias, tile, glu=True, pdl=True)
    return skinny_gemm.run(x, w, bias, tile, pdl=True)


def attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims, window, mlp=None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotary, the KV write and paged attention as one op (and with ``mlp``,
    Phi's activation of it beside): ``[B, H * D (+ I)]``. q, k, v ``[B, *]``,
    or ``[S, B, *]`` slices of sums that the kernels add and round to
    ``dtype`` (``rope_attention.rope_attend``)."""
    lead, b = q.shape[:-2], q.shape[-2]
    q = q.view(*lead, b, dims.heads, dims.head_dim)
    k = k.view(*lead, b, dims.kv_heads, dims.head_dim)
    v = v.view(*lead, b, dims.kv_heads, dims.head_dim)
    if qk_norm is not None:  # Phi's optional per-head LayerNorms: torch's kernels
        q = F.layer_norm(q, (dims.head_dim,), qk_norm[0], qk_norm[1], dims.eps)
        k = F.layer_norm(k, (dims.head_dim,), qk_norm[2], qk_norm[3], dims.eps)
    out = rope_attend(q, k, v, cos, sin, kv, ctx.slot_mapping, ctx.page_table, ctx.q_pos[:, 0],
                      ctx.cache.page_size, dims.scaling, window, mlp, dims.act,
                      dispatch=ctx.dispatch, pdl=True, dtype=dtype,
                      counters=dims.counters if b <= dims.combine_rows else None)
    return out if mlp is not None else out.reshape(b, -1)


def project_attend(h, w_qkv, b_qkv, cos, sin, kv, ctx, dims, window) -> torch.Tensor:
    """Llama's and Qwen2's q, k, v projection of ``h`` and attention over it.
    Where ``dims.pdl_tiles``' tile for the projection cuts K into slices,
    the projection leaves its partial sums (the bias in the first) and the
    attention kernels add them: more programs for a projection too narrow
    to cover the GPU, and no kernel to add the slices."""
    tile = dims.pdl_tiles.tile_for(h.shape[0], w_qkv.shape[1], w_qkv.shape[0])
    if tile is not None and tile.split > 1 and tile.fits(w_qkv.shape[1]):
        q, k, v = gemm(h, w_qkv, b_qkv, dims, partial=True).split(dims.split, dim=-1)
        return attend(q, k, v, cos, sin, kv, ctx, None, dims, window, dtype=h.dtype)
    q, k, v = gemm(h, w_qkv, b_qkv, dims).split(dims.split, dim=-1)
    return attend(q, k, v, cos, sin, kv, ctx, None, dims, window)


def parallel_layer(x, delta, cos, sin, kv, ctx, w, dims, act, window):
    """Phi: the norm (with the previous layer's sums), the fused q, k, v and
    fc1, attention with the activation beside it, the fused dense + fc2."""
    norm_w, norm_b, w_in, b_in, w_out, b_out, qk_norm = w
    x, h = add_norm(x, delta, norm_w, norm_b, dims.eps, rms=False, pdl=True)
    q, k, v, f = gemm(h, w_in, b_in, dims).split(dims.split, dim=-1)
    if dims.act:
        row = attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims, window, f)
    else:  # an activation the kernels do not know: torch's, between ours
        row = torch.cat((attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims, window), act(f)), -1)
    return x, gemm(row, w_out, b_out, dims, partial=True)


def sequential_layer(x, delta, cos, sin, kv, ctx, w, dims, act, window):
    """Llama, Qwen2: norm, q/k/v, attention, o_proj's sums into the second
    norm, gate and up as ``silu(gate) * up``, down."""
    norm1, w_qkv, b_qkv, w_o, b_o, norm2, w_gu, b_gu, w_down, b_down = w
    x, h = add_norm(x, delta, norm1, None, dims.eps, rms=True, pdl=True)
    a = project_attend(h, w_qkv, b_qkv, cos, sin, kv, ctx, dims, window)
    x, h = add_norm(x, gemm(a, w_o, b_o, dims, partial=True), norm2, None, dims.eps, rms=True,
                    pdl=True)
    if dims.glu:
        return x, gemm(gemm(h, w_gu, b_gu, dims, glu=True), w_down, b_down, dims, partial=True)
    gate, up = gemm(h, w_gu, b_gu, dims).split(dims.inter, dim=-1)
    return x, gemm(act(gate) * up, w_down, b_down, dims, partial=True)


def final(x, delta, weight, bias, eps, rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's output added: ``(hidden, final norm of it)``."""
    return add_norm(x, delta, weight, bias, eps, rms, pdl=True)


def combine(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``x`` plus the sums, rounded as ``add_norm`` rounds them (torch)."""
    return torch_add(x, delta)
