"""A GEMM for decode-sized inputs (Triton, CUDA): ``x [M, K] @ w[N, K]^T``
with M of 1-64 rows, where the whole cost is one pass over the weights.

Each program owns ``BLOCK_N`` output columns and one of ``split`` equal
slices of K, and multiplies all M rows at once, so every weight byte is read
once. With ``split`` > 1 the programs write float32 partial sums
``[split, M, N]`` and a second kernel adds them and the bias; with 1 the
program adds the bias and writes the output in x's dtype.

``linear`` runs the kernel where the backend's ``kernel_config.TileTable``
has a tile for the weight's shape and row count (by default the tiles
``bench.gemm_tune`` measured faster than cuBLAS on this GPU,
``kernel_config.MEASURED``) and ``F.linear`` everywhere else. It is a custom
op, so a compiled decode step calls it as one opaque call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.kernel_config import Tile, TileTable, tile_for

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


if triton is not None:

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, k_per, sx_m, sw_n, so_s, so_m,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        n0 = tl.program_id(0) * BLOCK_N
        s = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k0 = s * k_per
        for k in tl.range(k0, k0 + k_per, BLOCK_K, num_stages=STAGES):
            x = tl.load(x_ptr + rm[:, None] * sx_m + (k + rk)[None, :], mask=m_ok[:, None],
                        other=0.0)
            w = tl.load(w_ptr + rn[:, None] * sw_n + (k + rk)[None, :], mask=n_ok[:, None],
                        other=0.0)
            if IEEE:  # float32 inputs: full precision, as cuBLAS gives them here
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        mask = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(out_ptr + s * so_s + rm[:, None] * so_m + rn[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + rm[:, None] * so_m + rn[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _reduce_kernel(p_ptr, b_ptr, out_ptr, total, N, splits,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(p_ptr + s * total + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    """``[split, M, N]`` float32 partial sums (bias not added) when
    ``tile.split`` > 1, else ``[M, N]`` in x's dtype with the bias."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_gemm: x and w must be contiguous along K")
    if not tile.fits(k):
        raise ValueError(f"skinny_gemm: K={k} is not {tile.split} slices of {tile.block_k}")
    partial = tile.split > 1
    if partial:
        out = torch.empty((tile.split, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemm_kernel[(triton.cdiv(n, tile.block_n), tile.split)](
        x, w, bias if bias is not None else w, out, m, n, k // tile.split,
        x.stride(0), w.stride(0), out.stride(0) if partial else 0, out.stride(-2),
        HAS_BIAS=bias is not None, PARTIAL=partial, IEEE=x.dtype == torch.float32,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, STAGES=tile.stages, num_warps=tile.warps)
    return out


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through the kernel, partial sums reduced."""
    parts = launch(x, w, bias, tile)
    if tile.split == 1:
        return parts
    _, m, n = parts.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = 1024
    _reduce_kernel[(triton.cdiv(m * n, block),)](
        parts, bias if bias is not None else parts, out, m * n, n, tile.split,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
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
