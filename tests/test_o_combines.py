"""The output projection combining the split attention kernel's states
(``KernelConfig.o_combines``: ``paged_decode.split_states`` and
``skinny_gemm``'s STATES): on the CPU the config and the states' meaning,
on the GPU the kernels against the combining pass and whole steps against
the step without it. The GPU cases are skipped, with the reason, where
there is no CUDA."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend import paged_decode, pdl
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile
from bubblefree.cuda_backend.tiny import tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton kernels")
PDL = pytest.mark.skipif(not pdl.supported("cuda"),
                         reason="needs a GPU of compute capability 9 or later and Triton")
LAUNCHES = [False, pytest.param(True, marks=PDL)]


def test_o_combines_is_a_count_and_says_itself():
    said = str(KernelConfig(pdl_rows=8, o_combines=4, last_combines=2))
    assert "output projection combining split attention up to 4 rows" in said
    assert "last programs" not in said  # the projection combines there: no last programs do
    assert "last programs combining up to 8 rows" in str(
        KernelConfig(pdl_rows=8, o_combines=4, last_combines=8))
    assert "output projection" not in str(KernelConfig(o_combines=8))  # no dependent step
    assert "combining split attention at one row" in str(KernelConfig(pdl_rows=8, o_combines=1))
    for bad in (True, -1, 2.0, "2", None):
        with pytest.raises(ValueError, match="o_combines is a row count"):
            KernelConfig(pdl_rows=8, o_combines=bad)


def test_phi_keeps_its_combining_pass():
    """Phi's output GEMM reads the MLP's half beside the attention: the
    projection never combines there, whatever the config asks."""
    from tests.test_cuda_fused import backend
    asked = KernelConfig(pdl_rows=8, o_combines=8)
    assert backend(tiny_model("phi", seed=1), kernels=asked)._runner.decoder.dims.state_rows == 0


def _states_of(q, keys, values, cuts):
    """Attention of one query over ``keys`` as partial states over the key
    ranges ``cuts`` (the split kernel's, in torch): m, l, acc."""
    m, l, acc = [], [], []
    for lo, hi in cuts:
        s = keys[lo:hi] @ q
        if hi == lo:
            m.append(torch.tensor(float("-inf"))), l.append(torch.tensor(0.0))
            acc.append(torch.zeros(values.shape[1]))
            continue
        top = s.max()
        p = torch.exp(s - top)
        m.append(top), l.append(p.sum()), acc.append(p @ values[lo:hi])
    return torch.stack(m), torch.stack(l), torch.stack(acc)


@pytest.mark.parametrize("cuts", [[(0, 7), (7, 20), (20, 20), (20, 33)], [(0, 33)],
                                  [(0, 1), (1, 2), (2, 33)]])
def test_states_combine_to_the_attention_they_split(cuts):
    """``States.combined``: the softmax over every key, whichever way the
    keys were cut, an empty cut weighing nothing."""
    torch.manual_seed(len(cuts))
    q, keys, values = torch.randn(16), torch.randn(33, 16), torch.randn(33, 16)
    m, l, acc = _states_of(q, keys, values, cuts)
    states = paged_decode.States(m[None, None], l[None, None], acc[None, None], torch.float32)
    want = torch.softmax(keys @ q, 0) @ values
    torch.testing.assert_close(states.combined()[0, 0], want, rtol=1e-5, atol=1e-5)


def test_the_projection_takes_states_only_in_steps_of_whole_heads():
    from bubblefree.cuda_backend import skinny_gemm
    states = paged_decode.States(torch.zeros(1, 4, 2), torch.ones(1, 4, 2),
                                 torch.zeros(1, 4, 2, 64), torch.bfloat16)
    w = torch.zeros(32, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole heads of 64"):
        skinny_gemm.launch(states, w, None, Tile(32, 96, 1, 4, 3))


# -- on the GPU -----------------------------------------------------------------------


def _case(slices: int, positions: list[int], seed: int):
    """Rows of q, k, v as ``slices`` float32 slices of a projection's sums
    (one slice: the projection's bf16 output), over a bf16 paged cache."""
    from bubblefree.cuda_backend.kv_cache import PagedKVCache
    torch.manual_seed(seed)
    rows, heads, kv_heads, dim, ps, pages = len(positions), 8, 2, 64, 16, 12
    cache = PagedKVCache(layers=1, kv_heads=kv_heads, head_dim=dim, num_pages=rows * pages,
                         page_size=ps, dtype=torch.bfloat16, device=torch.device("cuda"))
    cache.data.normal_()
    table = torch.randperm(rows * pages, device="cuda").view(rows, pages)
    pos = torch.tensor(positions, device="cuda")
    slot = table.gather(1, (pos // ps)[:, None])[:, 0] * ps + pos % ps
    cuts = (heads * dim, kv_heads * dim, kv_heads * dim)
    parts = torch.randn(slices, rows, sum(cuts), device="cuda")
    if slices == 1:
        parts = parts.to(torch.bfloat16)
    q, k, v = (t.view(slices, rows, -1, dim) for t in parts.split(cuts, dim=-1))
    theta = torch.rand(rows, dim // 2, device="cuda") * 6
    cos, sin = (f(torch.cat((theta, theta), 1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    new = paged_decode.NewToken(k[0], v[0], cos, sin, slot, slices, parts.stride(0),
                                torch.bfloat16)
    return cache, q[0], table, pos, new


@CUDA
@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("positions,window", [([0, 37, 191], None), ([100, 5, 150], 40),
                                              ([191, 191, 64], 16)])
@pytest.mark.parametrize("launch_pdl", LAUNCHES)
@pytest.mark.parametrize("launch", [{}, dict(block=16, warps=1), dict(block=64, warps=4),
                                    dict(block=64, warps=1, max_splits=2)])
def test_the_projection_over_states_is_the_projection_over_the_combined_attention(
        slices, positions, window, launch_pdl, launch):
    """The split kernel without a combining pass writes the cache bit for
    bit as with one, its states combine to the combining pass's output (to
    bf16's rounding: sums in another order), and the output projection
    over them (partial sums, steps read ahead under dependent launches)
    gives the projection of that output. (In a whole step that rounding
    reaches later layers' keys, so there the tokens are compared.) The
    states' kernel in its launches: 16 keys an iteration in one warp, 64
    in four, and 64 in one warp with at most two programs a (row, head)
    (two iterations each)."""
    from bubblefree.cuda_backend import skinny_gemm
    cache, q, table, pos, new = _case(slices, positions, seed=slices + len(positions))
    before = cache.data.clone()
    keys, values = cache.layer_kv(0)[0], cache.layer_kv(0)[1]
    win = window if window is not None else paged_decode.NO_WINDOW
    args = (q, keys, values, table, pos, 16, 0.125, win)
    want = paged_decode.split_attention(*args, new=new, pdl=launch_pdl, prefetch=launch_pdl)
    written = cache.data.clone()
    cache.data.copy_(before)
    states = paged_decode.split_states(*args, new=new, pdl=launch_pdl, prefetch=launch_pdl,
                                       **launch)
    assert torch.equal(cache.data, written) and not torch.equal(written, before)
    assert states.acc.shape[:2] == (len(positions), 8) and states.acc.shape[2] > 1
    torch.testing.assert_close(states.combined(), want, rtol=1e-2, atol=1e-2)
    w = torch.randn(96, 8 * 64, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    for tile in ("32n64k8s4w3p", "32n128k2s4w3p2a", "64n256k1s4w3p2a"):
        t = Tile.parse(tile)
        got = skinny_gemm.launch(states, w, bias, t, bias_in_parts=True, partial=True,
                                 pdl=launch_pdl).sum(0)
        ref = skinny_gemm.launch(states.combined().view(len(positions), -1), w, bias, t,
                                 bias_in_parts=True, partial=True, pdl=launch_pdl).sum(0)
        # The kernel combines as States.combined does (sums in another order: a
        # bf16 rounding may differ), and the projection is the combining pass's.
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2, msg=tile)
        torch.testing.assert_close(got, F.linear(want.view(len(positions), -1).float(), w.float(),
                                                 bias.float()), rtol=2e-2, atol=2e-2, msg=tile)


@PDL
@pytest.mark.parametrize("positions,window", [([0, 37, 191], None), ([100, 5, 150], 40)])
def test_the_split_kernel_releasing_the_projection_early_changes_nothing(positions, window):
    """KernelConfig.early_attention: the split kernel lets the next kernel
    launch before it waits. The same states and cache, bit for bit, with
    a dependent kernel after it (the projection over its states)."""
    from bubblefree.cuda_backend import skinny_gemm
    cache, q, table, pos, new = _case(3, positions, seed=len(positions))
    before = cache.data.clone()
    keys, values = cache.layer_kv(0)[0], cache.layer_kv(0)[1]
    win = window if window is not None else paged_decode.NO_WINDOW
    w = torch.randn(96, 8 * 64, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    outs = []
    for early in (False, True, True):
        cache.data.copy_(before)
        states = paged_decode.split_states(q, keys, values, table, pos, 16, 0.125, win, new=new,
                                           pdl=True, prefetch=True, early=early)
        sums = skinny_gemm.launch(states, w, None, Tile.parse("32n128k2s4w3p2a"), partial=True,
                                  pdl=True)
        outs.append((states.m.clone(), states.l.clone(), states.acc.clone(), sums,
                     cache.data.clone()))
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


@PDL
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_step_whose_projection_combines_decodes_the_same_tokens(arch, monkeypatch):
    """Captured in CUDA graphs, the dependent step with the projection
    combining the states decodes the usual step's greedy tokens, and the
    states path did run (a 40-token prompt: buckets the split kernel takes)."""
    from tests.test_pdl_step import _small
    calls = []
    real = paged_decode.split_states
    monkeypatch.setattr(paged_decode, "split_states",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_model(arch, device="cuda", seed=4)
    prompts = [[5, 9, 17, 33, 4], [7, 8], [11] * 30, [3] * 40]
    want = generate(_small(model, kernels=KernelConfig.measured("cuda")), prompts, 10)
    be = _small(model, kernels=attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8,
                                            o_combines=8))
    assert be._decode_graphs.enabled and be._runner.decoder.dims.state_rows == 8
    assert generate(be, prompts, 10) == want
    assert calls


@PDL
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_step_whose_attention_releases_the_projection_early_decodes_the_same_tokens(arch):
    """KernelConfig.early_attention on the whole step, in graphs: greedy
    tokens equal the step's without it (the projection combining the
    states in both), and a step's logits (four rows in a bucket of 8, the
    split kernel everywhere) are exactly its own."""
    from bubblefree.cuda_backend.kernel_config import Dispatch
    from tests.test_pdl_step import _small, assert_same_steps
    model = tiny_model(arch, device="cuda", seed=4)
    base = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8, o_combines=8,
                        early_attention=0, dispatch=Dispatch(split_below=1 << 30))
    plain = _small(model, kernels=base)
    be = _small(model, kernels=attrs.evolve(base, early_attention=8))
    assert "attention kernel releasing" in str(be.kernels)
    assert be._runner.decoder.dims.early_attention_rows == 8
    assert_same_steps(be, plain, [[5, 9, 17, 33, 4], [7, 8], [11] * 30, [3] * 40])


def test_the_measured_one_row_tiles_are_read_in_whole_slices_as_measured():
    """Where ``o_combines`` is on by default (the H200's Llama-3.2-1B and
    Qwen2-0.5B shapes, one row), the output projection's tile in the table
    is the one that runs where the layers keep their norm kernels
    (``norms_in`` 0; by default that row runs without them): its slices are
    already whole steps of whole heads.
    Past the rows where it is on, Qwen2's tile (7 steps in 4 slices) could
    not be read so and would keep the split kernel's combining."""
    from bubblefree.bench.speed_setup import SHAPES
    from bubblefree.cuda_backend.pdl_step import whole_slices
    for name in ("llama1b", "qwen05b"):
        config = SHAPES[name]["config"]()
        kernels = KernelConfig.for_gpu("NVIDIA H200", config)
        d, hd = config.hidden_size, config.hidden_size // config.num_attention_heads
        assert kernels.o_combines == 1, name
        one = kernels.pdl_tiles.tile_for(1, d, d)
        assert whole_slices(one, d, hd) == attrs.evolve(one, ahead=d // one.block_k // one.split)
        assert whole_slices(one, d, hd).ahead == 1, name  # one step a slice: as measured
    qwen = KernelConfig.for_gpu("NVIDIA H200", SHAPES["qwen05b"]["config"]())
    assert whole_slices(qwen.pdl_tiles.tile_for(8, 896, 896), 896, 64) is None


@pytest.mark.parametrize("k,head_dim,tile,want", [
    (896, 64, "32n64k8s4w3p", "32n64k7s4w3p2a"),  # 14 steps: 7 slices of 2
    (2048, 64, "64n256k8s4w3p", "64n256k8s4w3p"),
    (2048, 64, "64n256k4s4w3p", "64n256k4s4w3p2a"),
    (896, 64, "32n128k4s4w3p", None),  # 7 steps: one slice, too few for 4
    (2048, 128, "64n64k4s4w3p", None),  # steps of 64 are half heads of 128
    (1000, 64, "64n64k4s4w3p", None),  # K is not whole steps
])
def test_a_projection_over_states_reads_each_slice_whole(k, head_dim, tile, want):
    from bubblefree.cuda_backend.pdl_step import whole_slices
    got = whole_slices(Tile.parse(tile), k, head_dim)
    assert got == (Tile.parse(want) if want else None)
    assert whole_slices(None, k, head_dim) is None


def test_the_projection_combines_only_where_the_split_kernel_runs_within_its_rows(monkeypatch):
    """``states_tile``: a tile only for buckets of at most ``state_rows`` rows
    that the dispatch gives the split kernel, on Triton's device (stood in
    for here), with a head size the kernels can tile."""
    from types import SimpleNamespace

    from bubblefree.cuda_backend import pdl_step
    from bubblefree.cuda_backend.fused_layers import Dims
    from bubblefree.cuda_backend.kernel_config import Dispatch, TileTable
    tile = Tile(128, 256, 8, 4, 3)
    dims = Dims(heads=32, kv_heads=8, head_dim=64, eps=1e-5, scaling=0.125, split=(2048, 512, 512),
                inter=8192, pdl_rows=8, pdl_tiles=TileTable({(2048, 2048): ((1, tile),)}),
                state_rows=1)
    w_o = torch.zeros(2048, 2048)

    def ctx(pages):
        return SimpleNamespace(page_table=torch.zeros(1, pages, dtype=torch.int32),
                               cache=SimpleNamespace(page_size=16), dispatch=Dispatch())

    one = torch.zeros(1, 2048)
    assert pdl_step.states_tile(one, w_o, ctx(8), dims) is None  # no Triton device here
    monkeypatch.setattr(paged_decode, "available", lambda x: True)
    assert pdl_step.states_tile(one, w_o, ctx(8), dims) == tile  # 128 keys: split
    assert pdl_step.states_tile(one, w_o, ctx(2), dims) is None  # 32 keys: one pass
    assert pdl_step.states_tile(torch.zeros(2, 2048), w_o, ctx(8), dims) is None  # past its rows
    odd = attrs.evolve(dims, head_dim=96)
    assert pdl_step.states_tile(one, w_o, ctx(8), odd) is None  # no power of two
