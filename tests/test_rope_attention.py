"""Rotary, the KV write and paged decode attention as one op
(cuda_backend/rope_attention.py), on the CPU: the op equals the three steps
it replaces, output and cache alike; compiled, it writes the layer's cache in
place rather than copying it; q, k and v as slices of a projection's sums
are added and rounded as its output would be; bad shapes are named. The Triton kernels that
run it on CUDA are checked against this path in tests/test_cuda_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from bubblefree.cuda_backend.attention import decode_attention, decode_context, store_kv
from bubblefree.cuda_backend.kernel_config import Dispatch
from bubblefree.cuda_backend.kv_cache import PagedKVCache
from bubblefree.cuda_backend.rope_attention import rope_attend, rotate

PS, PAGES, D = 4, 48, 16
# The attention dispatch the op is handed (on the CPU no kernel reads it).
DEFAULT = Dispatch()


def case(seed: int, heads: int, kv_heads: int, rot: int, rows: int = 5):
    """A cache of stale values, rows with scattered pages at mixed positions
    (the first at 0: its own key only), raw q/k/v and rotary tables."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(layers=2, kv_heads=kv_heads, head_dim=D, num_pages=PAGES,
                         page_size=PS, dtype=torch.float32, device=torch.device("cpu"))
    cache.data.normal_(generator=g)
    # Disjoint pages: each page has one owner (I6).
    table = torch.randperm(PAGES, generator=g)[:8 * rows].view(rows, 8)
    positions = torch.tensor([0, 3, 4, 17, 31][:rows])
    q = torch.randn(rows, heads, D, generator=g)
    k = torch.randn(rows, kv_heads, D, generator=g)
    v = torch.randn(rows, kv_heads, D, generator=g)
    theta = torch.rand(rows, rot // 2, generator=g) * 6
    cos, sin = torch.cat((theta, theta), 1).cos(), torch.cat((theta, theta), 1).sin()
    return cache, table, positions, q, k, v, cos, sin


@pytest.mark.parametrize("heads,kv_heads,rot,window", [
    (4, 4, D, None), (4, 2, D // 2, None), (6, 1, D, 5), (4, 4, D // 2, 1)])
def test_the_op_is_rotary_then_the_kv_write_then_attention(heads, kv_heads, rot, window):
    cache, table, positions, q, k, v, cos, sin = case(heads * 10 + rot, heads, kv_heads, rot)
    want_cache = PagedKVCache(layers=2, kv_heads=kv_heads, head_dim=D, num_pages=PAGES,
                              page_size=PS, dtype=torch.float32, device=torch.device("cpu"))
    want_cache.data.copy_(cache.data)
    ctx = decode_context(want_cache, positions, table, DEFAULT)
    keys, values = want_cache.layer(1)
    c, s = cos[:, None], sin[:, None]
    store_kv(keys, values, ctx.slot_mapping, rotate(k, c, s), v)
    want = decode_attention(rotate(q, c, s), keys, values, ctx, None, window)

    got = rope_attend(q, k, v, cos, sin, cache.layer_kv(1), ctx.slot_mapping, table, positions,
                      PS, None, window, dispatch=DEFAULT)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The same entries written (the rows' own slots of layer 1), nothing else.
    torch.testing.assert_close(cache.data, want_cache.data, rtol=0, atol=1e-6)


@pytest.mark.parametrize("act", [1, 2])
def test_with_an_mlp_input_the_op_returns_the_output_gemms_row(act):
    """A parallel block's output GEMM reads ``[attention | act(fc1)]``: with
    ``mlp`` the op returns that row, fc1 taken as a strided view."""
    cache, table, positions, q, k, v, cos, sin = case(7, 4, 2, D)
    slot = decode_context(cache, positions, table, DEFAULT).slot_mapping
    before = cache.data.clone()
    wide = torch.randn(len(positions), 40)
    mlp = wide[:, 8:]  # [B, 32], rows 40 apart
    row = rope_attend(q, k, v, cos, sin, cache.layer_kv(0), slot, table, positions, PS, None,
                      None, mlp, act, dispatch=DEFAULT)
    cache.data.copy_(before)
    attention = rope_attend(q, k, v, cos, sin, cache.layer_kv(0), slot, table, positions, PS,
                            None, None, dispatch=DEFAULT)
    gelu = torch.nn.functional.gelu(mlp, approximate="tanh" if act == 1 else "none")
    torch.testing.assert_close(row, torch.cat((attention.reshape(len(positions), -1), gelu), 1))


def _slices(q, k, v, count: int, seed: int):
    """q, k, v as ``count`` float32 slices of sums of one ``[S, B, N]``
    buffer (a projection that cut K), and their sums rounded to bf16."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.cat([t.reshape(len(t), -1) for t in (q, k, v)], 1)
    parts = torch.randn(count, *whole.shape, generator=g)
    parts[-1] = whole - parts[:-1].sum(0)  # the slices add up to q, k, v
    summed = parts[0].clone()
    for s in range(1, count):
        summed += parts[s]
    cuts = [t[0].numel() for t in (q, k, v)]
    sliced = [p.view(count, len(q), *t.shape[1:]) for p, t in zip(parts.split(cuts, -1), (q, k, v))]
    rounded = [p.view(t.shape).to(torch.bfloat16) for p, t in zip(summed.split(cuts, -1), (q, k, v))]
    return sliced, rounded


@pytest.mark.parametrize("count", [1, 3])
def test_slices_of_sums_are_added_and_rounded_as_the_projection_would(count):
    """q, k and v as ``[S, B, *, D]`` float32 slices of a projection's sums
    (``dtype`` the projection's): the same output and cache as the summed q,
    k and v rounded to that dtype, in it."""
    cache, table, positions, q, k, v, cos, sin = case(11, 4, 2, D)
    cache = PagedKVCache(layers=1, kv_heads=2, head_dim=D, num_pages=PAGES, page_size=PS,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.data.normal_(generator=torch.Generator().manual_seed(3))
    before = cache.data.clone()
    slot = decode_context(cache, positions, table, DEFAULT).slot_mapping
    (qs, ks, vs), (qr, kr, vr) = _slices(q, k, v, count, count)
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    args = (cos, sin, cache.layer_kv(0), slot, table, positions, PS, None, None)
    got = rope_attend(qs, ks, vs, *args, dispatch=DEFAULT, dtype=torch.bfloat16)
    written = cache.data.clone()
    cache.data.copy_(before)
    want = rope_attend(qr, kr, vr, *args, dispatch=DEFAULT)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(written, cache.data)
    assert not torch.equal(written, before)  # the rows' keys and values were written


def test_slices_of_sums_must_be_float32_of_one_buffer_with_a_dtype():
    cache, table, positions, q, k, v, cos, sin = case(12, 4, 2, D)
    slot = decode_context(cache, positions, table, DEFAULT).slot_mapping
    (qs, ks, vs), _ = _slices(q, k, v, 2, 0)
    args = (cos, sin, cache.layer_kv(0), slot, table, positions, PS, None, None)
    for bad in ((qs, ks, vs, {}), (qs.to(torch.bfloat16), ks, vs, {"dtype": torch.bfloat16}),
                (qs.clone(), ks, vs, {"dtype": torch.bfloat16}),  # another buffer's stride
                (qs, ks[:1], vs, {"dtype": torch.bfloat16}), (qs, k, vs, {"dtype": torch.bfloat16})):
        *qkv, kw = bad
        with pytest.raises(ValueError, match="slices of sums are float32 q, k and v"):
            rope_attend(*qkv, *args, dispatch=DEFAULT, **kw)


def _allocations(code: str) -> list[int]:
    """Element counts of the buffers inductor's generated code allocates."""
    sizes = []
    for shape in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", code):
        n = 1
        for dim in filter(None, (x.strip() for x in shape.split(","))):
            n *= int(dim)
        sizes.append(n)
    return sizes


def test_a_compiled_step_writes_the_cache_in_place():
    """The op mutates one tensor, the layer's cache; compiled, it must be
    handed that tensor, not a copy of it written back afterwards (a copy of
    a layer's whole cache per layer per step would cost more than the step)."""
    from torch._inductor.utils import run_and_get_code
    cache, table, positions, q, k, v, cos, sin = case(3, 4, 2, D)
    ctx = decode_context(cache, positions, table, DEFAULT)

    def layer(q, k, v, kv):
        return rope_attend(q * 1.5, k, v, cos, sin, kv, ctx.slot_mapping, table, positions, PS,
                           None, None, dispatch=ctx.dispatch).sum(-1)

    before = cache.data.clone()
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(layer), q, k, v, cache.layer_kv(0))
    biggest = max(_allocations("\n".join(codes)))
    assert biggest < cache.layer(0)[0].numel(), f"a buffer of {biggest} elements: a cache copy"
    written = (cache.data != before).any(dim=(-1, -2)).nonzero()
    assert written.shape[0] == 2 * len(positions)  # a key and a value per row, layer 0 only
    assert (written[:, 0] == 0).all()
    cache.data.copy_(before)
    eager = layer(q, k, v, cache.layer_kv(0))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    cache, table, positions, q, k, v, cos, sin = case(5, 4, 2, D)
    kv, slot = cache.layer_kv(0), decode_context(cache, positions, table, DEFAULT).slot_mapping
    args = dict(kv=kv, slot=slot, page_table=table, positions=positions, page_size=PS,
                scaling=None, window=None, dispatch=DEFAULT)
    with pytest.raises(ValueError, match=r"k \(5, 4, 16\).*cache's heads \(2, 16\)"):
        rope_attend(q, q, v, cos, sin, **args)
    with pytest.raises(ValueError, match="ROT even and at most 16"):
        rope_attend(q, k, v, cos[:, :3], sin[:, :3], **args)
    with pytest.raises(ValueError, match=r"mlp \(5, 8\) must be \[5, I\] with act 1"):
        rope_attend(q, k, v, cos, sin, **args, mlp=torch.zeros(5, 8), act=3)
    with pytest.raises(ValueError, match=r"slot \(4,\) must have one entry per row \(5\)"):
        rope_attend(q, k, v, cos, sin, **{**args, "slot": slot[:4]})
    with pytest.raises(ValueError, match=r"page_table \(3,\) must have one entry per row"):
        rope_attend(q, k, v, cos, sin, **{**args, "page_table": table[:3]})
    with pytest.raises(ValueError, match="q's last dimension must be contiguous"):
        rope_attend(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cos, sin, **args)
