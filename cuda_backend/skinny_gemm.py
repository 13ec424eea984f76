"""A GEMM for decode-sized inputs (Triton, CUDA): ``x [M, K] @ w[N, K]^T``
with M of 1-64 rows, where the whole cost is one pass over the weights.

Each program owns ``BLOCK_N`` output columns and one of ``split`` slices
of K (whole steps of ``BLOCK_K``, as equal as they divide), and multiplies
all M rows at once, so every weight byte is read once. With ``split`` > 1
the programs write float32 partial sums ``[split, M, N]`` and a second
kernel adds them and the bias; with 1 the program adds the bias and writes
the output in x's dtype.

``linear`` runs the kernel where the backend's ``kernel_config.TileTable``
has a tile for the weight's shape and row count (by default the tiles
``bench.gemm_tune`` measured faster than cuBLAS on this GPU,
``kernel_config.MEASURED``) and ``F.linear`` everywhere else. It is a custom
op, so a compiled decode step calls it as one opaque call.

The decode step with dependent launches (``KernelConfig.pdl``,
``pdl_step``) calls ``launch`` itself: every GEMM through the kernel, the
output projections' partial sums handed to the next norm instead of a
reduction kernel, the first weights read before the previous kernel ends,
and (``glu``) Llama's gate and up projections ending in ``silu(gate) * up``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.kernel_config import Tile, TileTable, tile_for
from bubblefree.cuda_backend.pdl import enter, launch_options, tl, triton


if triton is not None:

    @triton.jit
    def _mma(acc, x, w, IEEE: tl.constexpr):
        if IEEE:  # float32 inputs: full precision, as cuBLAS gives them here
            out = acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            out = acc + tl.dot(x, tl.trans(w))
        return out

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, steps, sx_m, sw_n, so_s, so_m, up_off,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr,
                GLU: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                AHEAD: tl.constexpr):
        """K is ``steps`` steps of BLOCK_K; slice s of the grid's takes steps
        ``s * steps // slices`` up to the next slice's first. GLU: w is
        ``[gate; up]`` (up from row ``up_off``) and the output column j is
        ``silu(gate_j) * up_j``, each rounded to x's dtype as torch's ops
        round them. PDL: the slice's first AHEAD steps of weights are read
        before the wait (``Tile.ahead``)."""
        n0 = tl.program_id(0) * BLOCK_N
        s = tl.program_id(1)
        slices = tl.num_programs(1)
        rm = tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None] * sw_n
        u_rows = w_ptr + (rn + up_off)[:, None] * sw_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k0 = (s * steps // slices) * BLOCK_K
        k1 = ((s + 1) * steps // slices) * BLOCK_K
        start = k0
        if PDL:  # the first steps' weights are read while the previous kernel ends
            # Names of their own: these tiles are AHEAD steps wide, the loop's one,
            # and a name the loop reassigns must keep one shape to compile.
            ra = tl.arange(0, AHEAD * BLOCK_K)
            w0 = tl.load(w_rows + (k0 + ra)[None, :], mask=n_ok[:, None], other=0.0)
            if GLU:
                wu0 = tl.load(u_rows + (k0 + ra)[None, :], mask=n_ok[:, None], other=0.0)
            enter(PDL)
            x0 = tl.load(x_ptr + rm[:, None] * sx_m + (k0 + ra)[None, :], mask=m_ok[:, None],
                         other=0.0)
            acc = _mma(acc, x0, w0, IEEE)
            if GLU:
                acc_up = _mma(acc_up, x0, wu0, IEEE)
            start = k0 + AHEAD * BLOCK_K
        for k in tl.range(start, k1, BLOCK_K, num_stages=STAGES):
            x = tl.load(x_ptr + rm[:, None] * sx_m + (k + rk)[None, :], mask=m_ok[:, None],
                        other=0.0)
            w = tl.load(w_rows + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
            acc = _mma(acc, x, w, IEEE)
            if GLU:
                wu = tl.load(u_rows + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
                acc_up = _mma(acc_up, x, wu, IEEE)
        mask = m_ok[:, None] & n_ok[None, :]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if PARTIAL:  # partial sums: the first slice carries it
                bias = tl.where(s == 0, bias, 0.0)
            acc += bias[None, :]
            if GLU:
                acc_up += tl.load(b_ptr + rn + up_off, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if PARTIAL:
            tl.store(out_ptr + s * so_s + rm[:, None] * so_m + rn[None, :], acc, mask=mask)
        else:
            dtype = out_ptr.dtype.element_ty
            if GLU:
                g = acc.to(dtype).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                acc = a * acc_up.to(dtype).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * so_m + rn[None, :], acc.to(dtype), mask=mask)

    @triton.jit
    def _reduce_kernel(p_ptr, b_ptr, out_ptr, total, N, splits,
                       HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        enter(PDL)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(p_ptr + s * total + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: Tile, *,
           bias_in_parts: bool = False, glu: bool = False, pdl: bool = False,
           partial: bool | None = None) -> torch.Tensor:
    """``[split, M, N]`` float32 partial sums when ``tile.split`` > 1 (or
    ``partial``), else ``[M, N]`` in x's dtype with the bias. Partial sums
    leave the bias out unless ``bias_in_parts`` (the first slice's sums then
    carry it). ``glu``: w (and the bias) are ``[gate; up]`` and the output,
    ``[M, N / 2]``, is ``silu(gate) * up`` (Llama's and Qwen2's MLP; K
    whole, no partial sums). ``pdl``: launched dependent on the previous
    kernel (``cuda_backend.pdl``)."""
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_gemm: x and w must be contiguous along K")
    if w.shape[1] != k:
        raise ValueError(f"skinny_gemm: w {tuple(w.shape)} does not take x's K={k}")
    if not tile.fits(k):
        raise ValueError(f"skinny_gemm: K={k} is not {tile.split} slices of at least "
                         f"{tile.ahead} steps of {tile.block_k}")
    partial = tile.split > 1 if partial is None else partial or tile.split > 1
    if glu and (partial or w.shape[0] % 2):
        raise ValueError("skinny_gemm: a GLU output needs K whole and [gate; up] of equal rows")
    if partial:
        out = torch.empty((tile.split, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(n, tile.block_n), tile.split)](
        x, w, bias if bias is not None else w, out, m, n, k // tile.block_k,
        x.stride(0), w.stride(0), out.stride(0) if partial else 0, out.stride(-2), n,
        HAS_BIAS=bias is not None and (not partial or bias_in_parts), PARTIAL=partial,
        IEEE=x.dtype == torch.float32, GLU=glu, PDL=pdl,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, STAGES=tile.stages, AHEAD=tile.ahead if pdl else 1,
        num_warps=tile.warps, **launch_options(pdl))
    return out


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: Tile, *,
        pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through the kernel, partial sums reduced."""
    parts = launch(x, w, bias, tile, pdl=pdl)
    if tile.split == 1:
        return parts
    _, m, n = parts.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = 1024
    _reduce_kernel[(triton.cdiv(m * n, block),)](
        parts, bias if bias is not None else parts, out, m * n, n, tile.split,
        HAS_BIAS=bias is not None, PDL=pdl, BLOCK=block, num_warps=4, **launch_options(pdl))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           tiles: TileTable) -> torch.Tensor:
    """``F.linear`` for 2-D x, through the kernel where ``tiles`` has a tile
    for w's shape (the row count decides inside the op, at capture)."""
    entries = tiles.scalars(w.shape[1], w.shape[0])
    if entries and available(x):
        return _skinny_linear(x, w, bias, entries)
    return F.linear(x, w, bias)


# The op takes its shape's entries as integers (TileTable.scalars): an op's
# arguments are tensors and scalars.
@torch.library.custom_op("bubblefree::skinny_linear", mutates_args=())
def _skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   tiles: list[int]) -> torch.Tensor:
    tile = tile_for(tiles, x.shape[0])
    # The table only ever speeds things up: anything it cannot serve is cuBLAS's.
    if (tile is None or not available(x) or not tile.fits(x.shape[1]) or x.stride(1) != 1
            or w.stride(1) != 1):
        return F.linear(x, w, bias)
    return run(x, w, bias, tile)


@_skinny_linear.register_fake
def _(x, w, bias, tiles):
    return x.new_empty((x.shape[0], w.shape[0]))
