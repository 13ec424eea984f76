"""A GEMM for decode-sized inputs (Triton, CUDA): ``x [M, K] @ w[N, K]^T``
with M of 1-64 rows, where the whole cost is one pass over the weights.

Each program owns ``BLOCK_N`` output columns and one of ``split`` equal
slices of K, and multiplies all M rows at once, so every weight byte is read
once. With ``split`` > 1 the programs write float32 partial sums
``[split, M, N]`` and a second kernel adds them and the bias; with 1 the
program adds the bias and writes the output in x's dtype.

``MEASURED`` holds the tiles ``bench.gemm_tune`` measured faster than
cuBLAS, per GPU, weight shape and row count; ``linear`` runs the kernel for
those and ``F.linear`` for everything else. It is a custom op, so a
compiled decode step calls it as one opaque call.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.tuning import parse_settings

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


@attrs.frozen
class Tile:
    """A launch: output columns per program, K per iteration, K slices,
    warps and pipeline stages. Written ``64n128k4s4w3p``: 64 columns, 128 of
    K, 4 slices, 4 warps, 3 stages."""
    block_n: int = 64
    block_k: int = 128
    split: int = 1
    warps: int = 4
    stages: int = 3

    def __str__(self) -> str:
        return f"{self.block_n}n{self.block_k}k{self.split}s{self.warps}w{self.stages}p"

    @classmethod
    def parse(cls, text: str) -> "Tile":
        tile = parse_settings(cls, r"(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p", "GEMM tile",
                              "e.g. 64n128k4s4w3p", text, ("block_n", "block_k", "warps"))
        if tile.block_k < 16 or tile.split < 1 or tile.stages < 1:
            raise ValueError(f"GEMM tile {text!r}: needs block_k >= 16 (the MMA's K), "
                             "split >= 1 and stages >= 1")
        return tile

    def fits(self, k: int) -> bool:
        """Whether K divides into ``split`` slices of whole BLOCK_K steps (the
        kernel does not mask K)."""
        return k % (self.split * self.block_k) == 0


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


Table = dict[tuple[int, int], tuple[tuple[int, "Tile | None"], ...]]

# Tiles measured faster than cuBLAS, per GPU: (K, N) -> ((up to rows, tile or
# None for cuBLAS), ...) by ascending rows; more rows than the last entry run
# cuBLAS. bench.gemm_tune on the H200 (docs/runs/gemm-tune-2026-11-30.txt),
# the moondream2 text decoder's shapes; a tile goes in at >= 3% faster. The
# head's tile at one row (1.04x alone) is left out: whole steps at one row
# were 0.5-0.9% slower with it (docs/runs/profile-2026-11-30.txt).
MEASURED: dict[str, Table] = {
    "NVIDIA H200": {
        (2048, 14336): ((32, None), (64, Tile(64, 128, 1, 4, 3))),  # fused q, k, v, fc1
        (10240, 2048): ((1, None), (32, Tile(32, 128, 4, 4, 5)),  # fused dense + fc2
                        (64, Tile(64, 128, 4, 4, 5))),
        (2048, 51200): ((1, None), (8, Tile(32, 256, 1, 4, 3)),  # head
                        (32, Tile(128, 128, 1, 4, 3)), (64, None)),
    },
}

# This process's table; None until ``tiles()`` reads MEASURED for its GPU.
TILES: Table | None = None


def tiles() -> Table:
    """``TILES``, first set from ``MEASURED`` for this process's GPU (other
    GPUs get an empty table, so cuBLAS, until they are measured)."""
    global TILES
    if TILES is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        TILES = dict(MEASURED.get(name, {}))
    return TILES


def tile_for(m: int, k: int, n: int) -> Tile | None:
    for rows, tile in (TILES or {}).get((k, n), ()):
        if m <= rows:
            return tile
    return None


def read_tiles(table: dict[str, list]) -> Table:
    """``TILES`` from ``bench.gemm_tune --save``'s JSON: ``{"K,N": [[rows,
    tile or null], ...]}``."""
    out = {}
    for shape, entries in table.items():
        k, n = map(int, shape.split(","))
        out[k, n] = tuple(sorted(((int(m), Tile.parse(t) if t else None) for m, t in entries),
                                 key=lambda e: e[0]))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for 2-D x, through the kernel where ``TILES`` has a tile
    for w's shape (the row count decides inside the op, at capture). The
    table is read when a step is traced: call ``tiles()`` first."""
    if TILES and (w.shape[1], w.shape[0]) in TILES and available(x):
        return _skinny_linear(x, w, bias)
    return F.linear(x, w, bias)


@torch.library.custom_op("bubblefree::skinny_linear", mutates_args=())
def _skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    tile = tile_for(x.shape[0], x.shape[1], w.shape[0])
    # The table only ever speeds things up: anything it cannot serve is cuBLAS's.
    if (tile is None or not available(x) or not tile.fits(x.shape[1]) or x.stride(1) != 1
            or w.stride(1) != 1):
        return F.linear(x, w, bias)
    return run(x, w, bias, tile)


@_skinny_linear.register_fake
def _(x, w, bias):
    return x.new_empty((x.shape[0], w.shape[0]))
