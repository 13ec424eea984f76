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
rows); a Llama or Qwen2 layer six (seven), or four (five) without norm
kernels (``chained_layer``). The layer functions take and
return the residual stream as ``(x, delta)``, ``delta`` being the last
projection's float32 partial sums ``[S, M, N]`` (bias included).
``FusedDecoder`` runs them for decode buckets of at most
``KernelConfig.pdl_rows`` rows, on CUDA devices that support it.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend import normed_gemv, paged_decode, skinny_gemm
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
    tile = _tile(x.shape[0], w, dims, partial, glu)
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


def _tile(rows: int, w: torch.Tensor, dims, partial: bool, glu: bool):
    """The GEMM tile for ``w`` at ``rows`` (``gemm``'s choice), or None."""
    k, n = w.shape[1], w.shape[0]
    tile = dims.pdl_tiles.tile_for(rows, k, n)
    if tile is None or not tile.fits(k) or (glu and tile.split > 1):
        tile = step_tile(k, n // 2 if glu else n, rows, partial, dims.sms)
    return tile


def _per_head(q, k, v, dims):
    """Flat q, k, v ``[(S,) B, *]`` as ``[(S,) B, heads, D]``."""
    lead = q.shape[:-1]
    return (q.view(*lead, dims.heads, dims.head_dim), k.view(*lead, dims.kv_heads, dims.head_dim),
            v.view(*lead, dims.kv_heads, dims.head_dim))


def attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims, window, mlp=None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotary, the KV write and paged attention as one op (and with ``mlp``,
    Phi's activation of it beside): ``[B, H * D (+ I)]``. q, k, v ``[B, *]``,
    or ``[S, B, *]`` slices of sums that the kernels add and round to
    ``dtype`` (``rope_attention.rope_attend``)."""
    b = q.shape[-2]
    q, k, v = _per_head(q, k, v, dims)
    if qk_norm is not None:  # Phi's optional per-head LayerNorms: torch's kernels
        q = F.layer_norm(q, (dims.head_dim,), qk_norm[0], qk_norm[1], dims.eps)
        k = F.layer_norm(k, (dims.head_dim,), qk_norm[2], qk_norm[3], dims.eps)
    out = rope_attend(q, k, v, cos, sin, kv, ctx.slot_mapping, ctx.page_table, ctx.q_pos[:, 0],
                      ctx.cache.page_size, dims.scaling, window, mlp, dims.act,
                      dispatch=ctx.dispatch, pdl=True, dtype=dtype,
                      counters=dims.counters if b <= dims.combine_rows else None)
    return out if mlp is not None else out.reshape(b, -1)


def states_tile(h: torch.Tensor, w_o: torch.Tensor, ctx, dims):
    """The output projection's tile where it combines the split attention
    kernel's states (``KernelConfig.o_combines``), else None: a bucket of
    at most ``dims.state_rows`` rows that the dispatch gives the split
    kernel, on Triton's device. The projection's tile, with each slice of K
    read whole before the wait (``skinny_gemm``'s STATES): its steps of K
    whole heads, cut into the most slices that divide them, no more than
    the tile's and at least half as many (fewer would leave the GPU
    idle: the combining pass then stays the split kernel's)."""
    b, hd = h.shape[0], dims.head_dim
    if b > dims.state_rows or not paged_decode.available(h) or hd & (hd - 1):
        return None
    length = ctx.page_table.shape[1] * ctx.cache.page_size
    if ctx.dispatch.choose(b, dims.heads, length) is not None:
        return None
    return whole_slices(_tile(b, w_o, dims, True, False), w_o.shape[1], hd)


def whole_slices(tile, k: int, head_dim: int):
    """``tile`` for a K of ``k`` read as slices of whole steps of whole
    heads, each slice read at once (``states_tile``), or None."""
    if tile is None or k % tile.block_k or tile.block_k % head_dim:
        return None
    steps = k // tile.block_k
    split = max(d for d in range(1, min(tile.split, steps) + 1) if steps % d == 0)
    return attrs.evolve(tile, split=split, ahead=steps // split) if 2 * split >= tile.split \
        else None


def _states(q, k, v, cos, sin, kv, ctx, dims, window, dtype) -> paged_decode.States:
    """``attend``'s attention left as the split kernel's states, for the
    output projection to combine (``paged_decode.split_states``)."""
    q, k, v = _per_head(q, k, v, dims)
    slices, stride = (q.shape[0], q.stride(0)) if q.dim() == 4 else (1, 0)
    if q.dim() == 4:
        q, k, v = q[0], k[0], v[0]
    new = paged_decode.NewToken(k, v, cos, sin, ctx.slot_mapping, slices, stride, dtype)
    window = int(window) if window is not None else paged_decode.NO_WINDOW
    scale = dims.scaling if dims.scaling is not None else dims.head_dim ** -0.5
    return paged_decode.split_states(q, kv[0], kv[1], ctx.page_table, ctx.q_pos[:, 0],
                                     ctx.cache.page_size, float(scale), window, new, pdl=True,
                                     prefetch=ctx.dispatch.prefetch,
                                     max_splits=ctx.dispatch.max_splits,
                                     early=q.shape[0] <= dims.early_attention_rows,
                                     block=ctx.dispatch.split_block,
                                     warps=ctx.dispatch.split_warps)


def project_attend(h, w_qkv, b_qkv, cos, sin, kv, ctx, dims, window, states: bool = False):
    """Llama's and Qwen2's q, k, v projection of ``h`` and attention over it.
    Where ``dims.pdl_tiles``' tile for the projection cuts K into slices,
    the projection leaves its partial sums (the bias in the first) and the
    attention kernels add them: more programs for a projection too narrow
    to cover the GPU, and no kernel to add the slices. ``states``: the
    attention as the split kernel's states (``states_tile`` said where)."""
    tile = dims.pdl_tiles.tile_for(h.shape[0], w_qkv.shape[1], w_qkv.shape[0])
    sliced = tile is not None and tile.split > 1 and tile.fits(w_qkv.shape[1])
    q, k, v = gemm(h, w_qkv, b_qkv, dims, partial=sliced).split(dims.split, dim=-1)
    if states:
        return _states(q, k, v, cos, sin, kv, ctx, dims, window, h.dtype)
    if sliced:
        return attend(q, k, v, cos, sin, kv, ctx, None, dims, window, dtype=h.dtype)
    return attend(q, k, v, cos, sin, kv, ctx, None, dims, window)


def parallel_layer(x, delta, cos, sin, kv, ctx, w, dims, act, window):
    """Phi: the norm (with the previous layer's sums), the fused q, k, v and
    fc1, attention with the activation beside it, the fused dense + fc2."""
    norm_w, norm_b, w_in, b_in, w_out, b_out, qk_norm = w
    x, h = add_norm(x, delta, norm_w, norm_b, dims.eps, rms=False, pdl=True,
                    early=x.shape[0] <= dims.early_rows)
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
    early = x.shape[0] <= dims.early_rows
    x, h = add_norm(x, delta, norm1, None, dims.eps, rms=True, pdl=True, early=early)
    o_tile = states_tile(h, w_o, ctx, dims)
    a = project_attend(h, w_qkv, b_qkv, cos, sin, kv, ctx, dims, window, o_tile is not None)
    if o_tile is not None:  # the projection combines the attention's states as it reads them
        sums = skinny_gemm.launch(a, w_o, b_o, o_tile, bias_in_parts=True, pdl=True, partial=True)
    else:
        sums = gemm(a, w_o, b_o, dims, partial=True)
    x, h = add_norm(x, sums, norm2, None, dims.eps, rms=True, pdl=True, early=early)
    if dims.glu:
        return x, gemm(gemm(h, w_gu, b_gu, dims, glu=True), w_down, b_down, dims, partial=True)
    gate, up = gemm(h, w_gu, b_gu, dims).split(dims.inter, dim=-1)
    return x, gemm(act(gate) * up, w_down, b_down, dims, partial=True)


def chained_layer(x, delta, cos, sin, kv, ctx, w, dims, act, window):
    """Llama, Qwen2 with a gated MLP in the buckets of at most
    ``dims.norms_in_rows`` rows: no norm kernels (``normed_gemv``). q, k, v
    and gate and up norm the residual stream themselves; o and down keep K
    whole and return the stream with their output added. ``delta`` is zero
    sums (``FusedDecoder._layers`` runs these layers only from the first)
    and comes back as it came, so ``final`` and ``combine`` take the
    stream as they take any layer's."""
    norm1, w_qkv, b_qkv, w_o, b_o, norm2, w_gu, b_gu, w_down, b_down = w
    q, k, v = _normed(x, w_qkv, b_qkv, dims, norm=norm1).split(dims.split, dim=-1)
    a = attend(q, k, v, cos, sin, kv, ctx, None, dims, window)
    x = _normed(a, w_o, b_o, dims, residual=x)
    return _normed(_normed(x, w_gu, b_gu, dims, norm=norm2, glu=True), w_down, b_down, dims,
                   residual=x), delta


def _normed(x, w, bias, dims, *, norm=None, residual=None, glu: bool = False) -> torch.Tensor:
    """``normed_gemv.run`` launched dependent (``chain_launch``'s launch)."""
    return normed_gemv.run(x, w, bias, chain_launch(x.shape[0], w, dims, glu), norm=norm,
                           eps=dims.eps, residual=residual, glu=glu, pdl=True)


def chain_launch(rows: int, w: torch.Tensor, dims, glu: bool) -> normed_gemv.Launch:
    """The launch of ``chained_layer``'s GEMM of ``w`` at ``rows``: the
    table's tile where it is one of the vector form with K whole (its
    columns, warps and ``e``), else ``normed_gemv.choose``'s."""
    k, n = w.shape[1], w.shape[0] // 2 if glu else w.shape[0]
    tile = dims.pdl_tiles.tile_for(rows, k, w.shape[0])
    if tile is not None and tile.vector and tile.split == 1:
        return normed_gemv.Launch(tile.block_n, tile.warps, bool(tile.early))
    return normed_gemv.choose(k, n, glu, dims.sms)


def chainable(w, dims, rows: int) -> bool:
    """Whether ``chained_layer`` can run a layer of weights ``w`` in buckets
    of up to ``rows`` rows: every GEMM's share fits a thread's registers
    (``normed_gemv.MAX_VALUES``; a model far wider than those measured may
    not), and the rows are ones the kernel unrolls."""
    _, w_qkv, _, w_o, _, _, w_gu, _, w_down, _ = w
    gemms = ((w_qkv, False), (w_o, False), (w_gu, True), (w_down, False))
    return rows <= normed_gemv.MAX_ROWS and all(
        normed_gemv.values(m.shape[1], chain_launch(r, m, dims, glu), glu) <= normed_gemv.MAX_VALUES
        for m, glu in gemms for r in range(1, rows + 1))


def final(x, delta, weight, bias, eps, rms: bool, *,
          early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's output added: ``(hidden, final norm of it)``;
    ``early``: the head may launch before the norm waits (``add_norm``)."""
    return add_norm(x, delta, weight, bias, eps, rms, pdl=True, early=early)


def combine(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``x`` plus the sums, rounded as ``add_norm`` rounds them (torch)."""
    return torch_add(x, delta)
