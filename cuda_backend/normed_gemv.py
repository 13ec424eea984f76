"""A Llama or Qwen2 layer's GEMMs without the norm kernels between them
(``KernelConfig.norms_in``): the vector form of the decode GEMM
(``skinny_gemv``) with K whole, norming its input itself or adding the
residual stream to its output.

In the dependent-launch step a layer is seven kernels at one row, two of
them norms that read a projection's slices of sums, add them to the
residual stream and norm it (``add_norm``). Here there are none:

- the output projections (o, down) keep K whole, so each program has its
  columns' whole sums, and add the residual stream to them: their output is
  the stream itself, ``x + round(x_in @ w^T)`` in x's dtype;
- the GEMM after each norm (q, k, v; gate and up) reads that stream and
  norms it before its products, every program the whole row: a row is at
  most a few thousand values, read from L2, where the norm kernel was a
  kernel boundary and a round of arrivals.

Every program holds its whole share of the weights in registers, asked for
before its wait (and, with ``early``, after letting the next kernel
launch), as the vector form does. K is read in two loads whose widths are
powers of two (the largest that fits K, then the rest rounded up), not one
rounded up: K = 4,864 takes 5,120 values of registers, not 8,192.

What a program does after its wait is on the step's path, each sum across
its threads a round of shuffles and, past one warp, barriers. So the
residual is asked for with x, not after the sums, and where K's two loads
are as wide (K = 896) their products, and the norm's squares, are added
before one reduction, not reduced apart (Qwen2-0.5B's one-row step 0.468
-> 0.435 ms: docs/performance.md, "The sums after the wait").

The sums are the norm kernel's and the GEMM's, rounded where they round:
RMSNorm in float32, rounded to x's dtype, times the weight and rounded
again; a projection's sums rounded to x's dtype before the residual add,
the add rounded; ``silu(gate) * up`` as ``skinny_gemv`` writes it.
``torch_run`` is the same in torch: the reference, and what runs where
Triton does not.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.add_norm import rms_norm
from bubblefree.cuda_backend.pdl import enter, launch_options, release, tl, triton, wait
from bubblefree.cuda_backend.skinny_gemv import DTYPES, MAX_ROWS, MAX_VALUES


@attrs.frozen
class Launch:
    """One GEMM's launch: output columns per program, warps, and whether it
    lets the next kernel launch before it loads and waits."""
    block_n: int
    warps: int
    early: bool = True

    def __str__(self) -> str:
        return (f"{self.block_n} column{'s' * (self.block_n > 1)} a program in {self.warps} "
                f"warp{'s' * (self.warps > 1)}")


def widths(k: int) -> tuple[int, int]:
    """K's two loads: the largest power of two not over ``k``, then the
    rest rounded up to a power of two (at least 16, masked whole where
    nothing is left)."""
    first = 1 << (k.bit_length() - 1)
    rest = k - first
    return first, max(16, 1 << (rest - 1).bit_length()) if rest else 16


def values(k: int, launch: Launch, glu: bool) -> int:
    """The weights a thread holds (gate's and up's with ``glu``)."""
    return launch.block_n * sum(widths(k)) * (2 if glu else 1) // (32 * launch.warps)


def choose(k: int, n: int, glu: bool, sms: int) -> Launch:
    """A launch for ``n`` output columns over a K of ``k`` where none was
    measured: the widest columns that still give two programs a
    multiprocessor, then the fewest warps that keep a thread's share at 128
    values (half of what it may hold: room for the sums)."""
    for block_n in (16, 8, 4, 2, 1):
        if block_n > 1 and -(-n // block_n) < 2 * sms:
            continue
        for warps in (1, 2, 4, 8):
            if values(k, Launch(block_n, warps), glu) <= 128:
                return Launch(block_n, warps)
    return Launch(1, 8)  # a K too wide for that: ``check`` says so where it is past the limit


if triton is not None:

    @triton.jit
    def _dot(wa, wb, xa, xb, K1: tl.constexpr, K2: tl.constexpr):
        """A program's sums of its columns' products over both loads of K:
        summed before the reduction where the loads are as wide (one
        reduction across the program's threads, not two; where the first
        load is all of K the compiler drops the second's)."""
        if K1 == K2:
            return tl.sum(wa.to(tl.float32) * xa[None, :] + wb.to(tl.float32) * xb[None, :], 1)
        return (tl.sum(wa.to(tl.float32) * xa[None, :], 1)
                + tl.sum(wb.to(tl.float32) * xb[None, :], 1))

    @triton.jit
    def _normed_gemv_kernel(x_ptr, g_ptr, w_ptr, b_ptr, r_ptr, out_ptr, N, eps, sx_m, sw_n,
                            sr_m, so_m, up_off, K: tl.constexpr, NORM: tl.constexpr,
                            RESID: tl.constexpr,
                            HAS_BIAS: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr,
                            BLOCK_N: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                            ROWS: tl.constexpr, EARLY: tl.constexpr):
        """K is a constant so that the second load's mask is known at
        compile time: its loads stay 16 bytes wide."""
        if EARLY:
            release(PDL)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        ka = tl.arange(0, K1)  # K1 <= K: no mask along K
        kb = K1 + tl.arange(0, K2)
        b_ok = kb < K
        wa = tl.load(w_ptr + rn[:, None] * sw_n + ka[None, :], mask=n_ok[:, None], other=0.0)
        wb = tl.load(w_ptr + rn[:, None] * sw_n + kb[None, :], mask=n_ok[:, None] & b_ok[None, :],
                     other=0.0)
        if GLU:
            ru = rn + up_off
            ua = tl.load(w_ptr + ru[:, None] * sw_n + ka[None, :], mask=n_ok[:, None], other=0.0)
            ub = tl.load(w_ptr + ru[:, None] * sw_n + kb[None, :],
                         mask=n_ok[:, None] & b_ok[None, :], other=0.0)
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        bias_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if GLU:
                bias_up = tl.load(b_ptr + rn + up_off, mask=n_ok, other=0.0).to(tl.float32)
        if NORM:
            ga = tl.load(g_ptr + ka).to(tl.float32)
            gb = tl.load(g_ptr + kb, mask=b_ok, other=0.0).to(tl.float32)
        if EARLY:
            wait(PDL)
        else:
            enter(PDL)
        dtype = out_ptr.dtype.element_ty
        for r in tl.static_range(ROWS):
            if RESID:  # asked for with x, so that its wait is not after the sums
                res = tl.load(r_ptr + r * sr_m + rn, mask=n_ok, other=0.0).to(tl.float32)
            xa = tl.load(x_ptr + r * sx_m + ka).to(tl.float32)
            xb = tl.load(x_ptr + r * sx_m + kb, mask=b_ok, other=0.0).to(tl.float32)
            if NORM:  # RMSNorm as add_norm computes it
                if K1 == K2:  # one reduction across the program, not two
                    squares = tl.sum(xa * xa + xb * xb, 0)
                else:
                    squares = tl.sum(xa * xa, 0) + tl.sum(xb * xb, 0)
                inv = tl.math.rsqrt(squares / K + eps)
                xa = ((xa * inv).to(dtype).to(tl.float32) * ga).to(dtype).to(tl.float32)
                xb = ((xb * inv).to(dtype).to(tl.float32) * gb).to(dtype).to(tl.float32)
            acc = _dot(wa, wb, xa, xb, K1, K2) + bias
            if GLU:
                up = _dot(ua, ub, xa, xb, K1, K2) + bias_up
                g = acc.to(dtype).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                acc = a * up.to(dtype).to(tl.float32)
            if RESID:  # the sums rounded as the GEMM's output would be, then the add
                acc = res + acc.to(dtype).to(tl.float32)
            tl.store(out_ptr + r * so_m + rn, acc.to(dtype), mask=n_ok)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in DTYPES


def check(x: torch.Tensor, w: torch.Tensor, launch: Launch, *, glu: bool,
          norm: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    """A clear error naming what cannot run: rows past what the kernel
    unrolls, weights not 16-bit, a share past ``MAX_VALUES`` a thread, or
    shapes that do not match."""
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"normed_gemv: at most {MAX_ROWS} rows, not {m}")
    if w.dtype not in DTYPES or x.dtype != w.dtype:
        raise ValueError(f"normed_gemv: 16-bit weights and inputs of their dtype, not "
                         f"{w.dtype} and {x.dtype}")
    if w.shape[1] != k or (glu and w.shape[0] % 2):
        raise ValueError(f"normed_gemv: w {tuple(w.shape)} does not take x {tuple(x.shape)}"
                         f"{' as [gate; up]' if glu else ''}")
    if (held := values(k, launch, glu)) > MAX_VALUES:
        raise ValueError(f"normed_gemv: {launch} would hold {held} weights a thread for K={k}; "
                         f"at most {MAX_VALUES}: narrower columns or more warps")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"normed_gemv: the norm's weight must be [{k}], not {tuple(norm.shape)}")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"normed_gemv: the residual must be [{m}, {n}], not "
                         f"{tuple(residual.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("normed_gemv: x, w and the residual must be contiguous along their rows")


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, launch: Launch, *,
        norm: torch.Tensor | None = None, eps: float = 0.0,
        residual: torch.Tensor | None = None, glu: bool = False,
        pdl: bool = False) -> torch.Tensor:
    """``F.linear(h, w, bias)`` ``[M, N]`` in x's dtype, ``h`` being x, or
    with ``norm`` its RMSNorm (weight ``norm``, ``eps``); with ``glu`` (w
    ``[gate; up]``) ``silu(gate) * up``; with ``residual`` ``[M, N]`` the
    output added to it. ``pdl``: launched dependent on the previous kernel
    (``cuda_backend.pdl``). Torch's where Triton does not run on x."""
    if not available(x):
        return torch_run(x, w, bias, norm=norm, eps=eps, residual=residual, glu=glu)
    check(x, w, launch, glu=glu, norm=norm, residual=residual)
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k1, k2 = widths(k)
    _normed_gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, norm if norm is not None else w, w, bias if bias is not None else w,
        residual if residual is not None else out, out, n, float(eps), x.stride(0),
        w.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), n, K=k,
        NORM=norm is not None, RESID=residual is not None, HAS_BIAS=bias is not None, GLU=glu,
        PDL=pdl, BLOCK_N=launch.block_n, K1=k1, K2=k2, ROWS=m, EARLY=launch.early and pdl,
        num_warps=launch.warps, **launch_options(pdl))
    return out


def torch_run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *,
              norm: torch.Tensor | None = None, eps: float = 0.0,
              residual: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
    """``run`` in torch, with its rounding."""
    h = rms_norm(x, norm, eps) if norm is not None else x
    out = F.linear(h, w, bias)
    if glu:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return residual + out if residual is not None else out
