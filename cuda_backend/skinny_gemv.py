"""The decode GEMM's vector form (a tile written with ``v``,
``Tile.vector``): ``x [M, K] @ w[N, K]^T`` for a few rows without the MMA,
each program holding its whole share of the weights in registers.

``skinny_gemm``'s MMA form stages weights through shared memory a step of
K at a time and, launched dependent, reads only its first ``ahead`` steps
before the wait. Here a program owns ``BLOCK_N`` columns and one slice of
K, and loads that slice whole with one masked load, every byte of it asked
for before the wait (nothing in the step writes weights), so a program
that is placed early has its whole share in flight while the kernel before
it still runs; after the wait it reads x's few values and adds the
products. Its sums are the MMA form's in another order (float32 products,
a tree sum); outputs, partial sums, bias and ``silu(gate) * up`` are the
MMA form's (``skinny_gemm._gemm_kernel``)."""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.pdl import enter, release, tl, triton, wait

# The most rows the vector form takes: each row is another pass over the
# registers, unrolled at compile time.
MAX_ROWS = 8
# The weights' dtypes it takes. In float32 a program's share is twice the
# registers, and ptxas ran for over ten minutes on one such kernel without
# finishing (16 columns by 1,024 of K); the measured tiles serve 16-bit
# weights only anyway (``measured.MEASURED_DTYPES``).
DTYPES = (torch.bfloat16, torch.float16)
# The most weights a thread holds: 256 16-bit values, 128 registers. A
# share past that spills, or never compiles: K whole (4,864) at 64 columns
# kept ptxas busy for minutes with gigabytes of memory.
MAX_VALUES = 256


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, steps, sx_m, sw_n, so_s, so_m, up_off,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, GLU: tl.constexpr,
                     PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SLICE: tl.constexpr, ROWS: tl.constexpr, EARLY: tl.constexpr = False):
        """Slice s of K is steps ``s * steps // slices`` up to the next
        slice's first, of BLOCK_K each; SLICE (a power of two) covers the
        widest slice and the load masks the rest. EARLY: the next kernel
        may launch before this one loads and waits (``pdl.release``)."""
        if EARLY:
            release(PDL)
        n0 = tl.program_id(0) * BLOCK_N
        s = tl.program_id(1)
        slices = tl.num_programs(1)
        rn = n0 + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        k0 = (s * steps // slices) * BLOCK_K
        k1 = ((s + 1) * steps // slices) * BLOCK_K
        rk = k0 + tl.arange(0, SLICE)
        k_ok = rk < k1
        ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn[:, None] * sw_n + rk[None, :], mask=ok, other=0.0)  # [BLOCK_N, SLICE]
        if GLU:
            wu = tl.load(w_ptr + (rn + up_off)[:, None] * sw_n + rk[None, :], mask=ok, other=0.0)
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        bias_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if PARTIAL:  # partial sums: the first slice carries it
                bias = tl.where(s == 0, bias, 0.0)
            if GLU:
                bias_up = tl.load(b_ptr + rn + up_off, mask=n_ok, other=0.0).to(tl.float32)
        if EARLY:
            wait(PDL)
        else:
            enter(PDL)
        for r in tl.static_range(ROWS):
            x = tl.load(x_ptr + r * sx_m + rk, mask=k_ok, other=0.0).to(tl.float32)  # [SLICE]
            acc = tl.sum(w.to(tl.float32) * x[None, :], 1) + bias  # [BLOCK_N]
            if PARTIAL:
                tl.store(out_ptr + s * so_s + r * so_m + rn, acc, mask=n_ok)
            else:
                dtype = out_ptr.dtype.element_ty
                if GLU:
                    up = tl.sum(wu.to(tl.float32) * x[None, :], 1) + bias_up
                    g = acc.to(dtype).to(tl.float32)
                    a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                    acc = a * up.to(dtype).to(tl.float32)
                tl.store(out_ptr + r * so_m + rn, acc.to(dtype), mask=n_ok)


def check(tile, rows: int, dtype: torch.dtype, width: int, glu: bool) -> None:
    """A clear error where the vector form cannot run: more rows than it
    unrolls, weights not 16-bit, or a share of the weights (``width`` of K
    by the tile's columns, gate's and up's with ``glu``) past
    ``MAX_VALUES`` a thread."""
    if rows > MAX_ROWS:
        raise ValueError(f"skinny_gemm: the vector form {tile} takes at most {MAX_ROWS} rows, "
                         f"not {rows}")
    if dtype not in DTYPES:
        raise ValueError(f"skinny_gemm: the vector form {tile} takes 16-bit weights, not {dtype}")
    values = tile.block_n * width * (2 if glu else 1) // (32 * tile.warps)
    if values > MAX_VALUES:
        raise ValueError(f"skinny_gemm: the vector form {tile} would hold {values} weights a "
                         f"thread here (K slices {width} wide{', gate and up' if glu else ''}); "
                         f"at most {MAX_VALUES}: narrower columns, more slices or more warps")


def slice_width(steps: int, split: int, block_k: int) -> int:
    """The load's width along K: the widest slice (whole steps), rounded up
    to a power of two."""
    widest = -(-steps // split) * block_k
    return 1 << (widest - 1).bit_length()
