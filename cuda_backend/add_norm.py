"""The residual add and the next norm as one kernel (Triton, CUDA), reading
an output projection's partial sums directly.

A decode layer ends with an output projection whose K is split over
programs (``skinny_gemm``: float32 partial sums ``[S, M, N]``, the bias in
the first slice); the next layer begins by adding that to the residual
stream and norming it. Here one program per row does all of it:

    delta = sum over s of parts[s]            (float32)
    x'    = x + delta                          (delta rounded to x's dtype
                                                first, as the GEMM's own
                                                output would be)
    h     = norm(x')                           (LayerNorm, or RMSNorm as
                                                transformers' Llama and
                                                Qwen2 compute it)

and writes ``x'`` and ``h`` in x's dtype. That is a reduction kernel and a
norm kernel fewer per projection. Launched dependent on the projection
(``cuda_backend.pdl``), the norm's weights are read before it has ended.
``torch_add_norm`` is the same computation in torch: the reference, and
what runs where Triton does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.pdl import enter, launch_options, release, tl, triton, wait


if triton is not None:

    @triton.jit
    def _add_norm_kernel(x_ptr, p_ptr, w_ptr, b_ptr, xo_ptr, h_ptr, N, splits, sx_m, sp_s,
                         sp_m, so_m, eps, RMS: tl.constexpr, HAS_B: tl.constexpr,
                         PDL: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                         EARLY: tl.constexpr):
        if EARLY:  # the next kernel is placed and reads its weights while ours waits
            release(PDL)
        m = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < N
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_B:
            b = tl.load(b_ptr + c, mask=ok, other=0.0).to(tl.float32)
        if EARLY:
            wait(PDL)
        else:
            enter(PDL)
        # x asked for with the slices, not after them: one round trip less.
        x = tl.load(x_ptr + m * sx_m + c, mask=ok, other=0.0)
        # SPLITS slices per load: one round trip for all of them, not one each
        # (19 slices one after the other took 4 us a row).
        si = tl.arange(0, SPLITS)
        acc = tl.zeros([SPLITS, BLOCK], dtype=tl.float32)
        for s0 in range(0, splits, SPLITS):
            sok = (s0 + si) < splits
            acc += tl.load(p_ptr + (s0 + si)[:, None] * sp_s + m * sp_m + c[None, :],
                           mask=sok[:, None] & ok[None, :], other=0.0)
        delta = tl.sum(acc, axis=0)
        delta = delta.to(x.dtype).to(tl.float32)
        xn = (x.to(tl.float32) + delta).to(x.dtype)
        tl.store(xo_ptr + m * so_m + c, xn, mask=ok)
        v = xn.to(tl.float32)
        if RMS:  # normalised in float32, rounded, then the weight
            h = v * tl.math.rsqrt(tl.sum(v * v, axis=0) / N + eps)
            h = h.to(x.dtype).to(tl.float32) * w
        else:
            mean = tl.sum(v, axis=0) / N
            centred = tl.where(ok, v - mean, 0.0)
            h = centred * tl.math.rsqrt(tl.sum(centred * centred, axis=0) / N + eps) * w
            if HAS_B:
                h += b
        tl.store(h_ptr + m * so_m + c, h.to(x.dtype), mask=ok)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _check(x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None) -> None:
    m, n = x.shape
    if parts.dim() != 3 or parts.shape[1:] != (m, n) or parts.dtype != torch.float32:
        raise ValueError(f"add_norm: parts {tuple(parts.shape)} {parts.dtype} must be float32 "
                         f"[S, {m}, {n}]")
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"add_norm: the norm's weight and bias must be [{n}]")


def add_norm(x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, rms: bool, *,
             pdl: bool = False, early: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, N]``, parts ``[S, M, N]`` float32 -> ``(x + sum(parts), norm
    of it)``, both ``[M, N]`` in x's dtype. ``rms``: RMSNorm (no bias), else
    LayerNorm with ``bias``. ``early`` (with ``pdl``): the next kernel may
    launch before this one waits for its predecessor (``pdl.release``)."""
    _check(x, parts, weight, bias)
    if not available(x):
        return torch_add_norm(x, parts, weight, bias, eps, rms)
    m, n = x.shape
    if x.stride(1) != 1 or parts.stride(2) != 1:
        raise ValueError("add_norm: x and parts must be contiguous along N")
    xo = torch.empty((m, n), dtype=x.dtype, device=x.device)
    h = torch.empty_like(xo)
    block, splits, warps = tiling(n, parts.shape[0])
    _add_norm_kernel[(m,)](
        x, parts, weight, bias if bias is not None else weight, xo, h, n, parts.shape[0],
        x.stride(0), parts.stride(0), parts.stride(1), xo.stride(0), float(eps),
        RMS=rms, HAS_B=bias is not None, PDL=pdl, BLOCK=block, SPLITS=splits,
        EARLY=early and pdl, num_warps=warps, **launch_options(pdl))
    return xo, h


def tiling(n: int, slices: int) -> tuple[int, int, int]:
    """``(BLOCK, SPLITS, warps)`` for rows of ``n`` and ``slices`` slices:
    the row whole, up to 16,384 values a load (all 8 slices of a 2,048-wide
    row in one round trip, not two), and 16 warps once a load holds more
    than 8,192 (8 for smaller loads: 16 were slower on Qwen2-0.5B's rows of
    896). On the H200 this took Llama-3.2-1B's step from 0.908 to 0.862 ms
    and Phi-1.5's from 0.929 to 0.900 at one row
    (docs/runs/add-norm-2026-12-01g.txt)."""
    block, slices = 1 << (n - 1).bit_length(), 1 << (slices - 1).bit_length()  # powers of 2
    splits = min(slices, max(1, 16384 // block))
    return block, splits, 16 if block * splits > 8192 else 8


def torch_add(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """``x`` plus the sums of ``parts``, rounded to x's dtype before the add
    as the kernel rounds them (the slices summed in another order: equal to
    float32 rounding)."""
    return x + sum_slices(parts).to(x.dtype)


def sum_slices(parts: torch.Tensor) -> torch.Tensor:
    """Slices of sums ``[S, ...]`` (float32) added one after the other, in
    float32: the order the kernels that read them add them in."""
    total = parts[0].clone()
    for s in range(1, parts.shape[0]):
        total += parts[s]
    return total


def torch_add_norm(x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float,
                   rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_norm`` in torch, with its rounding."""
    xn = torch_add(x, parts)
    if rms:
        return xn, rms_norm(xn, weight, eps)
    return xn, F.layer_norm(xn, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama and Qwen2 compute it (and the kernels
    here): in float32, rounded to x's dtype, then times the weight."""
    v = x.float()
    return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
