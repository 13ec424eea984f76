"""A prefill layer's rotary, KV write and MLP activation as one kernel.

A prefill (packed image and prompt rows, or a prompt's token rows) writes
its new keys and values before it attends, so the decode step's one op
(``rope_attention``) does not fit it. Eager, that glue is a dozen kernels a
layer between the input GEMM and attention: slices, a negation, two
concatenations and three elementwise kernels of rotary for each of q and k,
two index copies into the cache, and for Phi the MLP activation and the
concatenation its output GEMM reads. Each is a few microseconds of launch
and tail at a prefill's sizes; moondream2's 24 layers pay them on every
image prefill, inside its graph or not.

``rope_store`` does it in one launch, a program per (token, part): part 0
rotates the token's query heads into a contiguous ``[T, H, D]``, part 1
rotates its key heads and writes them at its cache slot, part 2 writes its
values there, and parts 3 .. apply the activation to a share of its MLP
columns into ``act_dst`` (Phi's ``[attention | act(fc1)]`` row). Rotary
runs in float32 and rounds once, as the decode kernels do
(``paged_decode_kernels._rope``); the key is rounded to the cache's dtype.

CUDA with Triton only (``available``); elsewhere the layers keep their
torch steps (``fused_layers._attend``).
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend import paged_decode_kernels as kernels

triton = kernels.triton
if triton is not None:
    import triton.language as tl

    from bubblefree.cuda_backend.paged_decode_kernels import _gelu, _rope

    @triton.jit
    def rope_store_kernel(q_ptr, k_ptr, v_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                          qo_ptr, sqo_t, keys_ptr, values_ptr, skc_t, skc_h, svc_t, svc_h,
                          cs_ptr, sn_ptr, scs_t, slot_ptr, f_ptr, sf_t, fo_ptr, sfo_t, f_n,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                          H_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, ROT: tl.constexpr,
                          ACT: tl.constexpr, BLOCK_F: tl.constexpr):
        t = tl.program_id(0)
        part = tl.program_id(1)
        h = tl.arange(0, H_BLOCK)[:, None]  # [H_BLOCK, 1]
        d = tl.arange(0, D_BLOCK)[None, :]  # [1, D_BLOCK]
        cs, sn = cs_ptr + t * scs_t, sn_ptr + t * scs_t
        if part == 0:
            mask = (h < HEADS) & (d < D)
            x = _rope(q_ptr + t * sq_t + h * sq_h, d, cs, sn, mask, ROT, 0, 1, tl.float32)
            tl.store(qo_ptr + t * sqo_t + h * D + d, x.to(qo_ptr.dtype.element_ty), mask=mask)
        elif part == 1:
            mask = (h < KV_HEADS) & (d < D)
            x = _rope(k_ptr + t * sk_t + h * sk_h, d, cs, sn, mask, ROT, 0, 1, tl.float32)
            slot = tl.load(slot_ptr + t)
            tl.store(keys_ptr + slot * skc_t + h * skc_h + d,
                     x.to(keys_ptr.dtype.element_ty), mask=mask)
        elif part == 2:
            mask = (h < KV_HEADS) & (d < D)
            x = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=mask, other=0.0)
            slot = tl.load(slot_ptr + t)
            tl.store(values_ptr + slot * svc_t + h * svc_h + d,
                     x.to(values_ptr.dtype.element_ty), mask=mask)
        else:
            if ACT != 0:
                c = (part - 3) * BLOCK_F + tl.arange(0, BLOCK_F)
                ok = c < f_n
                f = tl.load(f_ptr + t * sf_t + c, mask=ok, other=0.0).to(tl.float32)
                tl.store(fo_ptr + t * sfo_t + c,
                         _gelu(f, ACT).to(fo_ptr.dtype.element_ty), mask=ok)


def available(q: torch.Tensor) -> bool:
    return triton is not None and q.is_cuda


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


ACT_BLOCK = 1024  # MLP columns per program: Phi-1.5's 8,192 are 8 programs a token


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor,
               act_src: torch.Tensor | None = None, act_dst: torch.Tensor | None = None,
               act: int = 0) -> torch.Tensor:
    """q ``[T, H, D]``, k and v ``[T, KVH, D]`` (the input GEMM's views),
    cos and sin ``[T, ROT]`` (transformers' layout, halves repeated); keys
    and values ``[N, KVH, D]``, written at ``slot`` ``[T]``. Returns q after
    rotary, contiguous ``[T, H, D]``. With ``act`` (``rope_attention.
    ACTIVATIONS``' kinds) also ``act_dst = act(act_src)``, ``[T, I]`` each."""
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("keys", keys),
                    ("values", values)):
        if x.stride(-1) != 1:
            raise ValueError(f"rope_store: {name}'s last dimension must be contiguous")
    if k.shape != v.shape or k.shape[0] != t or keys.shape[1:] != (kv_heads, dim) \
            or values.shape[1:] != (kv_heads, dim):
        raise ValueError(f"rope_store: k {tuple(k.shape)}, v {tuple(v.shape)} and the cache "
                         f"{tuple(keys.shape)} do not match q {tuple(q.shape)}")
    if cos.shape != sin.shape or cos.shape[0] != t or cos.shape[1] > dim or cos.shape[1] % 2:
        raise ValueError(f"rope_store: cos {tuple(cos.shape)} must be [{t}, ROT], ROT even, "
                         f"at most {dim}")
    if slot.shape != (t,):
        raise ValueError(f"rope_store: slot {tuple(slot.shape)} must be [{t}]")
    out = torch.empty((t, heads, dim), dtype=q.dtype, device=q.device)
    parts, f_n = 3, 0
    if act:
        if act not in (1, 2) or act_src is None or act_dst is None \
                or act_src.shape != act_dst.shape or act_src.shape[0] != t \
                or act_src.stride(1) != 1 or act_dst.stride(1) != 1:
            raise ValueError(f"rope_store: act {act} needs act_src and act_dst [{t}, I], "
                             f"rows contiguous")
        f_n = act_src.shape[1]
        parts += -(-f_n // ACT_BLOCK)
    if t == 0:
        return out
    f_src = act_src if act else q
    f_dst = act_dst if act else q
    rope_store_kernel[(t, parts)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out, out.stride(0), keys, values, keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), cos, sin, cos.stride(0), slot, f_src, f_src.stride(0), f_dst,
        f_dst.stride(0), f_n, HEADS=heads, KV_HEADS=kv_heads, D=dim,
        H_BLOCK=_pow2(max(heads, kv_heads)), D_BLOCK=_pow2(dim), ROT=cos.shape[1], ACT=act,
        BLOCK_F=ACT_BLOCK)
    return out
