"""The drawn sampler's noise as Triton code (CUDA), for ``KernelConfig.draw_kernel``.

``sampling.sample_tokens`` draws Gumbel-max: each token's scaled logit plus
``-log(-log(u))``, ``u`` a uniform hashed from (seed, position, token)
(``sampling.uniforms``). In torch that noise is some thirty element-wise
kernels over the vocabulary (the hash's 32-bit multiplies in 16-bit halves,
shifts, xors, two logarithms) before the argmax. Here it is a function a
kernel calls per token: the same hash in 32-bit arithmetic, the same
uniform (exact: 23 bits, a half step in, a power of two), and CUDA's
``logf`` (libdevice's) for the logarithms.

Two kernels call it, so that what they draw is one function of the same
bits: ``greedy_sample``'s kernel for a step whose drawn rows have no cut
(the masked argmax of the scaled logits plus the noise, in one launch),
and ``noise`` below for a step with a cut, whose sort and cumulative sums
stay torch's and add this noise. A row without a cut thus draws the same
token either way, as the torch paths do (``Draw``).
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.pdl import tl, triton
from bubblefree.cuda_backend.sampling import Draws

if triton is not None:
    from triton.language.extra import libdevice  # CUDA's math functions on CUDA

BLOCK = 4096  # tokens a program of ``noise`` writes


if triton is not None:

    @triton.jit
    def mix32(x):
        """``sampling.mix32`` ("lowbias32") on uint32 ``x``, wrapping as it masks."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def row_key(seed_lo, seed_hi, position):
        """A row's key (``sampling.uniforms``' ``key``) from its int64 seed
        halves and position (the position's low 32 bits, as it masks)."""
        inner = mix32(position.to(tl.uint32))
        return mix32(seed_lo.to(tl.uint32) ^ mix32(seed_hi.to(tl.uint32) ^ inner))

    @triton.jit
    def noise_at(key, cols):
        """``-log(-log(u))`` float32 at token ids ``cols`` for a row's ``key``
        (``sampling.unit`` of the hash of the key and the token's salt)."""
        salt = mix32(cols.to(tl.uint32) ^ 0x9E3779B9)
        h = mix32(key ^ salt)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        return -libdevice.log(-libdevice.log(u))

    @triton.jit
    def _noise_kernel(seed_lo_ptr, seed_hi_ptr, pos_ptr, out_ptr, V, so_m, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = row_key(tl.load(seed_lo_ptr + row), tl.load(seed_hi_ptr + row), tl.load(pos_ptr + row))
        tl.store(out_ptr + row * so_m + cols, noise_at(key, cols), mask=cols < V)
else:  # pragma: no cover - exercised where Triton is absent
    mix32 = row_key = noise_at = None


def noise(draws: Draws, token_salt: torch.Tensor) -> torch.Tensor:
    """``sampling.gumbel_noise``'s contract in one launch: the rows' noise
    ``[B, V]`` float32 for ``draws``' seeds and positions, ``V`` being
    ``token_salt``'s length (the salts themselves are hashed here, not
    read). Its logarithms are CUDA's."""
    if triton is None or not draws.seed_lo.is_cuda:
        raise ValueError("gumbel.noise: a Triton kernel, CUDA only")
    b, v = draws.seed_lo.shape[0], token_salt.shape[0]
    out = torch.empty((b, v), dtype=torch.float32, device=draws.seed_lo.device)
    _noise_kernel[(b, triton.cdiv(v, BLOCK))](
        draws.seed_lo, draws.seed_hi, draws.position, out, v, out.stride(0), BLOCK=BLOCK,
        num_warps=4)
    return out


def available(device: torch.device) -> bool:
    """Whether the kernels run on ``device`` (CUDA with Triton)."""
    return triton is not None and torch.device(device).type == "cuda"
