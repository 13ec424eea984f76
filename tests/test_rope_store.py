"""A prefill layer's rotary, KV write and MLP activation in one kernel
(cuda_backend/rope_store.py): on CUDA it equals the torch steps it replaces
(rotary in float32, rounded once; the cache written at the token's slots
and nowhere else; GELU in float32), for grouped and partial-rotary heads;
bad shapes are named before anything launches (on any device). End to end,
the moondream and Phi prefills that run it are checked against their
reference models in tests/test_moondream_gpu.py and tests/test_cuda_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.rope_attention import rotate
from bubblefree.cuda_backend.rope_store import ACT_BLOCK, rope_store

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a Triton kernel")


def case(tokens, heads, kv_heads, dim, rot, inter, dtype, device, seed=0):
    """The input GEMM's output ``[T, H*D + 2*KVH*D + I]`` and its q, k, v, f
    views; rotary tables in transformers' layout; a cache of stale values
    and distinct slots for the tokens."""
    g = torch.Generator().manual_seed(seed)
    width = heads * dim + 2 * kv_heads * dim + inter
    y = torch.randn(tokens, width, generator=g).to(dtype).to(device)
    q, k, v, f = y.split((heads * dim, kv_heads * dim, kv_heads * dim, inter), dim=-1)
    theta = torch.rand(tokens, rot // 2, generator=g) * 6
    cos = torch.cat((theta, theta), 1).cos().to(dtype).to(device)
    sin = torch.cat((theta, theta), 1).sin().to(dtype).to(device)
    n = 3 * tokens + 5
    keys = torch.randn(n, kv_heads, dim, generator=g).to(dtype).to(device)
    values = torch.randn(n, kv_heads, dim, generator=g).to(dtype).to(device)
    slot = torch.randperm(n, generator=g)[:tokens].to(device)
    return (q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim),
            v.view(tokens, kv_heads, dim), f, cos, sin, keys, values, slot)


def torch_steps(q, k, v, f, cos, sin, keys, values, slot, act):
    """What the kernel replaces, at its precision: rotary in float32."""
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    keys, values = keys.clone(), values.clone()
    keys[slot] = rotate(k.float(), c, s).to(keys.dtype)
    values[slot] = v.to(values.dtype)
    out = None
    if act:
        out = F.gelu(f.float(), approximate="tanh" if act == 1 else "none").to(f.dtype)
    return rotate(q.float(), c, s).to(q.dtype), keys, values, out


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    # tokens, heads, kv heads, head dim, rotary dims, MLP width, activation
    (1, 4, 4, 16, 16, 0, 0),            # one token, whole-head rotary, no rider
    (37, 32, 32, 64, 32, 8192, 1),      # Phi-1.5: partial rotary, tanh GELU over 8 programs
    (19, 8, 2, 64, 64, ACT_BLOCK + 3, 2),  # grouped heads, erf GELU with a ragged last block
    (300, 14, 2, 64, 64, 0, 0),         # Qwen2-0.5B's heads, many tokens
])
def test_the_kernel_equals_the_torch_steps(shape, dtype):
    tokens, heads, kv_heads, dim, rot, inter, act = shape
    q, k, v, f, cos, sin, keys, values, slot = case(tokens, heads, kv_heads, dim, rot, inter,
                                                    dtype, "cuda")
    want_q, want_keys, want_values, want_f = torch_steps(q, k, v, f, cos, sin, keys, values,
                                                         slot, act)
    row = torch.full((tokens, heads * dim + inter), 7.0, dtype=dtype, device="cuda")
    got = rope_store(q, k, v, cos, sin, keys, values, slot, f if act else None,
                     row[:, heads * dim:] if act else None, act)
    assert got.shape == (tokens, heads, dim) and got.is_contiguous()
    # float32 math rounded once on both sides: equal but for an ulp of rounding
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want_q, **tol)
    torch.testing.assert_close(keys, want_keys, **tol)  # written at the slots, the rest stale
    torch.testing.assert_close(values, want_values, atol=0, rtol=0)
    if act:
        torch.testing.assert_close(row[:, heads * dim:], want_f, **tol)
    assert (row[:, :heads * dim] == 7.0).all()  # the attention's columns are left alone


def test_bad_shapes_are_named_before_anything_runs():
    q, k, v, f, cos, sin, keys, values, slot = case(4, 4, 2, 16, 8, 24, torch.float32, "cpu")
    row = torch.zeros(4, 64 + 24)
    with pytest.raises(ValueError, match="slot"):
        rope_store(q, k, v, cos, sin, keys, values, slot[:3])
    with pytest.raises(ValueError, match="cos"):
        rope_store(q, k, v, cos[:, :7], sin[:, :7], keys, values, slot)
    with pytest.raises(ValueError, match="do not match"):
        rope_store(q, k, v[:, :1], cos, sin, keys, values, slot)
    with pytest.raises(ValueError, match="do not match"):
        rope_store(q, k, v, cos, sin, keys[:, :1], values, slot)
    with pytest.raises(ValueError, match="act 1 needs"):
        rope_store(q, k, v, cos, sin, keys, values, slot, f, None, 1)
    with pytest.raises(ValueError, match="act 3 needs"):
        rope_store(q, k, v, cos, sin, keys, values, slot, f, row[:, 64:], 3)
    with pytest.raises(ValueError, match="q's last dimension"):
        rope_store(q[..., ::2], k, v, cos, sin, keys, values, slot)
