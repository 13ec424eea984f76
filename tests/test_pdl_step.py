"""The decode step with dependent launches (cuda_backend/pdl_step.py): its
GEMM tiles, the residual add with the norm over partial sums, and on a GPU
the kernels against torch and whole steps against the step without it.
The GPU cases are skipped, with the reason, where there is no CUDA."""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from bubblefree.cuda_backend import pdl
from bubblefree.cuda_backend.add_norm import add_norm, torch_add, torch_add_norm
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile, TileTable, step_tile
from bubblefree.cuda_backend.tiny import tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton kernels")
PDL = pytest.mark.skipif(not pdl.supported("cuda"),
                         reason="needs a GPU of compute capability 9 or later and Triton")
# Each kernel launched plainly, and dependent on the one before where the GPU can.
LAUNCHES = [False, pytest.param(True, marks=PDL)]
PROMPTS = [[5, 9, 17, 33, 4], [7, 8], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2], [11] * 30]


@given(k=st.integers(1, 16384), n=st.integers(1, 200_000), rows=st.integers(1, 64),
       partial=st.booleans(), sms=st.integers(1, 200))
def test_a_step_tile_cuts_k_in_whole_steps_and_covers_the_gpu_where_it_can(k, n, rows, partial,
                                                                           sms):
    tile = step_tile(k, n, rows, partial, sms)
    if k % 16:
        assert tile is None  # the kernel does not mask K
        return
    assert isinstance(tile, Tile) and tile.fits(k) and tile.block_k >= 16
    programs = -(-n // tile.block_n) * tile.split
    if not partial:
        assert tile.split == 1  # its output feeds a kernel as is: no sums left over
        assert tile.block_n == 16 or programs >= sms
    else:  # the fewest slices of K (at most 16) that cover the GPU twice, or the most programs
        cols = -(-n // tile.block_n)
        wide = [b for b in (128, 64) if k % b == 0]  # steps of 64 or more where K allows
        assert tile.block_k >= 64 or not wide
        reach = max(cols * s for b in (wide or [tile.block_k])
                    for s in range(1, min(k // b, 16) + 1) if (k // b) % s == 0)
        assert tile.split <= 16 and programs >= min(2 * sms, reach)
        fewer = [s for b in (wide or [tile.block_k]) for s in range(1, tile.split)
                 if (k // b) % s == 0 and s <= k // b]
        assert all(cols * s < 2 * sms for s in fewer)  # no fewer slices would do


@pytest.mark.parametrize("k", [896, 2048, 4864, 8192, 10240])
def test_the_tuners_grid_serves_its_k_and_cuts_slices_that_do_not_divide_it(k):
    """``bench.pdl_tune``'s candidates: each fits K; an output projection's
    are slices of K, among them counts that do not divide K's steps (what
    the kernel's unequal slices are for); a GEMM whose output feeds a kernel
    keeps K whole; 1, 2 or 4 steps are read ahead."""
    from bubblefree.bench.pdl_tune import grid
    for partial, glu in ((True, False), (False, False), (False, True)):
        tiles = grid(k, partial, glu)
        assert tiles and all(t.fits(k) for t in tiles)
        assert {t.ahead for t in tiles} <= {1, 2, 4} and 1 in {t.ahead for t in tiles}
        if partial:
            assert all(t.split > 1 for t in tiles)
            assert any((k // t.block_k) % t.split for t in tiles)
        else:
            assert all(t.split == 1 for t in tiles)


def test_the_sums_are_added_in_the_streams_dtype_before_the_norm():
    """add_norm's rounding: the projection's sum rounded to x's dtype (as
    the reduction kernel's output was), then added, then normed."""
    torch.manual_seed(0)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    parts = torch.randn(4, 3, 40)
    w, b = torch.randn(40, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    want = x + (parts[0] + parts[1] + parts[2] + parts[3]).to(torch.bfloat16)
    assert torch.equal(torch_add(x, parts), want)
    xn, h = torch_add_norm(x, parts, w, b, 1e-5, rms=False)
    assert torch.equal(xn, want) and torch.equal(h, F.layer_norm(want, (40,), w, b, 1e-5))
    xn, h = torch_add_norm(x, parts, w, None, 1e-6, rms=True)
    v = want.float()
    assert torch.equal(h, w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))


def test_add_norm_names_mismatched_inputs():
    x = torch.zeros(2, 8)
    for parts, weight, says in [(torch.zeros(1, 2, 8, dtype=torch.float16), torch.ones(8), "float32"),
                                (torch.zeros(1, 3, 8), torch.ones(8), r"\[S, 2, 8\]"),
                                (torch.zeros(2, 8), torch.ones(8), "parts"),
                                (torch.zeros(1, 2, 8), torch.ones(7), r"weight and bias must be \[8\]")]:
        with pytest.raises(ValueError, match=says):
            add_norm(x, parts, weight, None, 1e-5, rms=True)


def test_add_norm_reads_a_rows_slices_in_as_few_loads_as_its_warps_hold():
    """The row whole; up to 16,384 values a load, so the 8 slices of a
    2,048-wide row come in one load (16 warps), and 8 warps for loads of
    8,192 or fewer (Qwen2-0.5B's 896-wide rows)."""
    from bubblefree.cuda_backend.add_norm import tiling
    assert tiling(2048, 8) == (2048, 8, 16)
    assert tiling(2048, 1) == (2048, 1, 8)
    assert tiling(896, 8) == (1024, 8, 8)
    assert tiling(896, 19) == (1024, 16, 16)
    assert tiling(8192, 8) == (8192, 2, 16)
    assert tiling(100, 3) == (128, 4, 8)
    assert tiling(40000, 2) == (65536, 1, 16)


def test_pdl_rows_is_a_count_and_says_itself():
    assert "dependent launches up to 8 rows" in str(KernelConfig(pdl_rows=8))
    assert "dependent" not in str(KernelConfig())
    assert "last programs combining up to 2 rows" in str(KernelConfig(pdl_rows=8, last_combines=2))
    # Capped by the dependent step's rows: its buckets are the only ones it changes.
    assert "combining up to 8 rows" in str(KernelConfig(pdl_rows=8, last_combines=64))
    assert "combining" not in str(KernelConfig(last_combines=8))  # no dependent step: no effect
    with pytest.raises(ValueError):
        KernelConfig(pdl_rows=-1)
    for bad in (True, -1, 2.0, "2", None):  # a row count: not a flag, nor negative
        with pytest.raises(ValueError, match="last_combines is a row count"):
            KernelConfig(pdl_rows=8, last_combines=bad)
        with pytest.raises(ValueError, match="early_norms is a row count"):
            KernelConfig(pdl_rows=8, early_norms=bad)
    assert "norms releasing the next kernel early up to 2 rows" in str(
        KernelConfig(pdl_rows=8, early_norms=2))
    assert "releasing" not in str(KernelConfig(early_norms=8))  # no dependent step: no effect
    for bad in (True, -1, 2.0, "2", None):
        with pytest.raises(ValueError, match="early_attention is a row count"):
            KernelConfig(pdl_rows=8, early_attention=bad)
    # Only where the projection combines the split kernel's states (o_combines).
    assert "attention kernel releasing the projection early at one row" in str(
        KernelConfig(pdl_rows=8, o_combines=1, early_attention=8))
    assert "attention kernel releasing the projection early up to 2 rows" in str(
        KernelConfig(pdl_rows=8, o_combines=2, early_attention=8))
    assert "attention kernel releasing" not in str(KernelConfig(pdl_rows=8, early_attention=8))


def test_where_it_cannot_launch_dependent_the_step_is_the_usual_one():
    """On the CPU (and GPUs before Hopper) pdl_rows changes nothing."""
    from tests.test_cuda_fused import backend, decode_logits
    model = tiny_model("llama", seed=7)
    plain = backend(model)
    asked = backend(model, kernels=KernelConfig(pdl_rows=64, last_combines=64))
    decoder = asked._runner.decoder
    assert not pdl.supported("cpu") and decoder.dims.pdl_rows == 0 and decoder.dims.counters is None
    assert asked.decode_path == plain.decode_path == "fused llama"
    torch.manual_seed(0)
    plain.cache.data.normal_()
    asked.cache.data.copy_(plain.cache.data)
    assert torch.equal(decode_logits(asked, decoder, [1, 6, 17, 9]),
                       decode_logits(plain, plain._runner.decoder, [1, 6, 17, 9]))


# -- on the GPU -----------------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,splits,rms", [(1, 2048, 1, False), (5, 896, 19, True),
                                            (64, 2048, 8, True), (3, 100, 2, False),
                                            (2, 2048, 8, False), (1, 896, 8, True)])
@pytest.mark.parametrize("launch_pdl,early", [(False, False), (False, True),
                                              pytest.param(True, False, marks=PDL),
                                              pytest.param(True, True, marks=PDL)])
def test_the_add_norm_kernel_matches_torch(m, n, splits, rms, dtype, launch_pdl, early):
    torch.manual_seed(m + n)
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    parts = torch.randn(splits, m, n, device="cuda") / splits
    w = torch.randn(n, device="cuda", dtype=dtype)
    b = None if rms else torch.randn(n, device="cuda", dtype=dtype)
    xo, h = add_norm(x, parts, w, b, 1e-5, rms, pdl=launch_pdl, early=early)
    rx, rh = torch_add_norm(x, parts, w, b, 1e-5, rms)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(xo, rx, rtol=tol, atol=tol)
    torch.testing.assert_close(h, rh, rtol=tol, atol=tol)


GEMMS = [(1, 2048, 96, "64n128k1s4w3p"), (5, 512, 2048, "32n128k4s4w3p"),
         (33, 896, 100, "16n128k7s4w3p"), (64, 256, 64, "64n128k2s4w3p"),
         # slices of 2 and 3 steps; steps read before the wait
         (1, 4864, 96, "32n128k16s4w3p2a"), (8, 896, 1152, "32n128k3s4w3p2a"),
         (3, 1024, 80, "16n64k4s4w3p4a"),
         # the measured tiles that read most ahead
         (1, 2048, 3072, "64n256k2s8w3p4a"), (8, 4864, 896, "32n128k8s4w3p4a"),
         (1, 8192, 2048, "64n256k8s4w3p2a"),
         # the vector form: K whole, slices of 19 steps, slices of 2 and 3
         # steps (the load masked past each), columns past a block
         (1, 896, 4864, "16n128k1s4w1pv"), (8, 4864, 896, "64n256k19s4w1pv"),
         (5, 896, 100, "16n128k3s4w1pv"), (2, 2048, 96, "32n256k2s8w1pv"),
         # ... letting the next kernel launch before it loads and waits,
         # in both forms
         (1, 896, 4864, "16n128k1s4w1pve"), (8, 4864, 896, "64n256k19s4w1pve"),
         (1, 2048, 3072, "64n256k2s8w3p4ae"), (8, 4864, 896, "32n128k8s4w3p4ae")]
# 64 columns by 256 of K in float32 need more shared memory than a
# multiprocessor has (gated, or four steps read ahead: Triton's
# OutOfResources), which is why the measured tiles serve 16-bit weights only
# (KernelConfig.for_gpu, test_gemm_compiles.py): those run in bfloat16 alone.
# The vector form ("v") takes 16-bit weights alone (``skinny_gemv.DTYPES``).
WIDE = {"64n256k2s8w3p4a", "64n256k8s4w3p2a", "64n256k2s8w3p4ae"}


@CUDA
@pytest.mark.parametrize("m,k,n,tile,dtype", [(*g, d) for g in GEMMS
                                              for d in (torch.float32, torch.bfloat16)
                                              if d == torch.bfloat16 or not (
                                                  g[3] in WIDE or Tile.parse(g[3]).vector)])
@pytest.mark.parametrize("launch_pdl", LAUNCHES)
def test_the_gemm_hands_sums_with_the_bias_and_writes_the_gated_mlp(m, k, n, tile, dtype,
                                                                    launch_pdl):
    """Partial sums with the bias in the first slice, whole outputs, and
    ``silu(gate) * up`` of a ``[gate; up]`` weight, each against torch."""
    from bubblefree.cuda_backend import skinny_gemm, skinny_gemv
    torch.manual_seed(m)
    t = Tile.parse(tile)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def close(got, want):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < tol, err

    parts = skinny_gemm.launch(x, w, bias, t, bias_in_parts=True, partial=True, pdl=launch_pdl)
    assert parts.shape == (t.split, m, n) and parts.dtype == torch.float32
    close(parts.sum(0), F.linear(x.float(), w.float(), bias.float()))
    close(skinny_gemm.run(x, w, bias, t, pdl=launch_pdl), F.linear(x.float(), w.float(), bias.float()))
    whole = attrs.evolve(t, split=1)  # a GLU output keeps K whole
    w2 = torch.cat((w, torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5))
    b2 = torch.randn(2 * n, device="cuda", dtype=dtype)
    gate, up = F.linear(x, w2, b2).chunk(2, dim=-1)
    held = whole.block_n * skinny_gemv.slice_width(k // whole.block_k, 1, whole.block_k) * 2
    if whole.vector and held > skinny_gemv.MAX_VALUES * 32 * whole.warps:
        # K whole is more than the vector form holds a thread
        with pytest.raises(ValueError, match="weights a thread"):
            skinny_gemm.launch(x, w2, b2, whole, glu=True, pdl=launch_pdl)
        return
    got = skinny_gemm.launch(x, w2, b2, whole, glu=True, pdl=launch_pdl)
    assert got.shape == (m, n) and got.dtype == dtype
    close(got, F.silu(gate) * up)
    with pytest.raises(ValueError, match="GLU"):
        skinny_gemm.launch(x, w2, b2, whole, glu=True, partial=True)


@CUDA
@pytest.mark.parametrize("kernel", ["split", "1x16w1s1", "4x32w4s3"])
@pytest.mark.parametrize("slices", [2, 5])
@pytest.mark.parametrize("launch_pdl", LAUNCHES)
def test_the_attention_kernels_add_q_k_v_slices_as_the_projection_would(kernel, slices,
                                                                        launch_pdl):
    """q, k and v as float32 slices of a projection's sums: the kernels'
    output and the cache they write are bit for bit those of the slices
    added in order and rounded to bf16 first (the projection's own output)."""
    from bubblefree.cuda_backend.kernel_config import Dispatch, Launch
    from bubblefree.cuda_backend.kv_cache import PagedKVCache
    from bubblefree.cuda_backend.rope_attention import rope_attend
    torch.manual_seed(slices)
    rows, heads, kv_heads, dim, ps, pages = 5, 8, 2, 64, 16, 6
    cache = PagedKVCache(layers=1, kv_heads=kv_heads, head_dim=dim, num_pages=rows * pages,
                         page_size=ps, dtype=torch.bfloat16, device=torch.device("cuda"))
    cache.data.normal_()
    before = cache.data.clone()
    table = torch.randperm(rows * pages, device="cuda").view(rows, pages)
    positions = torch.tensor([0, 3, 16, 40, pages * ps - 1], device="cuda")
    slot = table.gather(1, (positions // ps)[:, None])[:, 0] * ps + positions % ps
    cuts = (heads * dim, kv_heads * dim, kv_heads * dim)
    parts = torch.randn(slices, rows, sum(cuts) + 8, device="cuda")  # a wider buffer's columns
    summed = parts[0].clone()
    for i in range(1, slices):
        summed += parts[i]
    views = parts[..., :-8].split(cuts, dim=-1)
    sliced = [t.view(slices, rows, -1, dim) for t in views]
    rounded = [t.view(rows, -1, dim).to(torch.bfloat16) for t in summed[:, :-8].split(cuts, -1)]
    theta = torch.rand(rows, dim // 2, device="cuda") * 6
    cos, sin = (f(torch.cat((theta, theta), 1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    dispatch = (Dispatch().forced(split_below=1 << 30) if kernel == "split"
                else Dispatch().forced(split_below=0, launch=Launch.parse(kernel)))
    args = (cos, sin, cache.layer_kv(0), slot, table, positions, ps, None, None)
    got = rope_attend(*sliced, *args, dispatch=dispatch, pdl=launch_pdl, dtype=torch.bfloat16)
    written = cache.data.clone()
    cache.data.copy_(before)
    want = rope_attend(*rounded, *args, dispatch=dispatch, pdl=launch_pdl)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(written, cache.data)
    assert not torch.equal(written, before)


def _small(model, **kw):
    from bubblefree.cuda_backend.backend import CudaBackend
    args = dict(page_size=16, num_pages=64, max_rows=8, max_seqs=16, max_prefill_tokens=256,
                max_context=256, compile_decode=False)
    args.update(kw)
    return CudaBackend(model, **args)


@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
def test_the_dependent_step_gives_the_usual_steps_logits(arch):
    """Eager, outside graphs: the same logits as the fused step without it,
    to float32 rounding (sums in another order)."""
    from tests.test_cuda_fused import decode_logits
    model = tiny_model(arch, device="cuda", seed=7)
    plain = _small(model, page_size=4, max_rows=8, kernels=KernelConfig.measured("cuda"))
    assert "dependent" not in plain.decode_path
    be = _small(model, page_size=4, max_rows=8, kernels=attrs.evolve(
        KernelConfig.measured("cuda"), pdl_rows=64))
    assert "dependent launches up to 64 rows" in be.decode_path
    torch.manual_seed(0)
    plain.cache.data.normal_()
    be.cache.data.copy_(plain.cache.data)
    got = decode_logits(be, be._runner.decoder, [1, 6, 17, 9])
    want = decode_logits(plain, plain._runner.decoder, [1, 6, 17, 9])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@PDL
@pytest.mark.parametrize("arch,rows", [("phi", 8), ("llama", 8), ("qwen2", 8), ("phi", 1)])
def test_the_dependent_step_in_graphs_decodes_the_same_tokens(arch, rows):
    """Captured in CUDA graphs, the buckets of at most ``rows`` rows run it
    (one row: only the smallest bucket, the others the usual step); greedy
    tokens equal the usual step's and transformers' generate."""
    from tests.test_cuda_gpu import reference
    model = tiny_model(arch, device="cuda", seed=4)
    first = reference(model, PROMPTS, 10)  # before a backend takes the model's attention
    want = generate(_small(model, kernels=KernelConfig.measured("cuda")), PROMPTS, 10)
    be = _small(model, kernels=attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=rows))
    assert be._decode_graphs.enabled
    assert generate(be, PROMPTS, 10) == want == first


@PDL
@pytest.mark.parametrize("shape", ["phi", "llama1b", "qwen05b"])
def test_the_dependent_step_in_bf16_keeps_each_measured_shapes_tokens(shape):
    """Each shape measured for this GPU (moondream2's text decoder, Llama-3.2-1B,
    Qwen2-0.5B) in bf16, with its measured defaults (its tiles, the norms
    releasing early where they do): the dependent step's greedy tokens equal
    the usual step's."""
    from bubblefree.bench.speed_setup import build_model
    model, _ = build_model(False, shape=shape)
    prompts = [[5, 9, 17, 33, 4], [7, 8, 1000, 2000]]
    measured = KernelConfig.measured("cuda", model.config)
    assert measured.pdl_rows == 8
    want = generate(_small(model, max_rows=4, kernels=attrs.evolve(measured, pdl_rows=0)),
                    prompts, 16)
    got = generate(_small(model, max_rows=4, kernels=attrs.evolve(measured, pdl_rows=4)),
                   prompts, 16)
    # bf16 sums in another order may flip a near tie late; the first tokens agree.
    assert [g[:8] for g in got] == [w[:8] for w in want]


@PDL
def test_a_float32_model_of_a_measured_shape_runs_on_the_plain_defaults():
    """Llama-3.2-1B's shape in float32, where its measured q, k, v tile
    would ask more shared memory than a multiprocessor has: the backend
    takes the plain defaults (``MEASURED_DTYPES``), builds, and decodes
    transformers' own greedy tokens."""
    from transformers import LlamaForCausalLM

    from bubblefree.bench.speed_setup import SHAPES
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(SHAPES["llama1b"]["config"]()).eval()
    prompts = [[5, 9, 17, 33, 4], [7, 8, 1000, 2000]]
    want = []  # before the backend: it makes the model's attention its own
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            want.append(ids[0, len(p):].tolist())
    be = _small(model, max_rows=4)
    assert be.kernels == KernelConfig()
    assert generate(be, prompts, 8) == want


def test_the_measured_defaults_name_their_shape():
    """The dependent step is on by default only where it was measured faster
    (MEASURED_PDL: the H200; the Phi-1.5, Llama-3.2-1B and Qwen2-0.5B
    shapes), never on the CPU, nor for another shape of the same
    architecture: its tiles were tuned for that shape's GEMMs, and each
    measured shape's GEMMs all have one."""
    from transformers import LlamaConfig

    from bubblefree.bench.speed_setup import SHAPES
    from bubblefree.cuda_backend.kernel_config import Dispatch
    from bubblefree.cuda_backend.measured import MEASURED_PDL, model_shape

    assert set(MEASURED_PDL["NVIDIA H200"]) == {model_shape(s["config"]()) for s in SHAPES.values()}
    for name, spec in SHAPES.items():
        config = spec["config"]()
        h200 = KernelConfig.for_gpu("NVIDIA H200", config)
        assert h200.pdl_rows == 8, name
        # The last programs combine where it was measured faster: Llama-3.2-1B
        # and Phi-1.5 at 1 and 2 rows, not Qwen2-0.5B (even there).
        assert h200.last_combines == (0 if name == "qwen05b" else 2), name
        # The output projection combines the split kernel's states where it was
        # measured faster: Llama-3.2-1B and Qwen2-0.5B (Phi's output GEMM also
        # reads the MLP's half, so it never does).
        assert h200.o_combines == (0 if name == "phi" else 1), name
        # The norms release the next kernel early where it was measured faster:
        # Llama-3.2-1B and Qwen2-0.5B, not Phi-1.5 (slower there).
        assert h200.early_norms == (0 if name == "phi" else 8), name
        # The split attention kernel releases the output projection early where
        # that was measured faster: Llama-3.2-1B at one row (Qwen2-0.5B even).
        assert h200.early_attention == (1 if name == "llama1b" else 0), name
        # The layers run without norm kernels where that was measured faster:
        # Llama-3.2-1B and Qwen2-0.5B at one row (Phi's layers are parallel).
        assert h200.norms_in == (0 if name == "phi" else 1), name
        # A split bucket's (row, head) runs in one program where that was
        # measured faster: Phi-1.5 up to 8 rows and 256 keys (slower at 8 rows
        # of 512), Llama-3.2-1B up to 4 rows (slower at 8) and 512 keys,
        # Qwen2-0.5B at one row (slower from two) and 512 keys (even at 256).
        assert h200.dispatch == {"phi": Dispatch(whole_rows=8),
                                 "llama1b": Dispatch(whole_rows=4, whole_keys=512),
                                 "qwen05b": Dispatch(whole_rows=1, whole_keys=512)}[name], name
        assert KernelConfig.measured("cpu", config).dispatch == Dispatch()
        assert KernelConfig.measured("cpu", config).norms_in == 0
        assert KernelConfig.measured("cpu", config).early_attention == 0
        assert KernelConfig.measured("cpu", config).early_norms == 0
        assert KernelConfig.measured("cpu", config).o_combines == 0
        assert KernelConfig.measured("cpu", config).last_combines == 0
        assert KernelConfig.measured("cpu", config).pdl_rows == 0
        assert KernelConfig.for_gpu("NVIDIA H100 80GB HBM3", config).pdl_rows == 0
        # Measured in bfloat16: float16 moves the same bytes and takes them;
        # float32 weights, for which some tiles do not fit a multiprocessor's
        # shared memory, get the plain defaults (cuBLAS, the compiled step).
        assert KernelConfig.for_gpu("NVIDIA H200", config, dtype=torch.float16) == h200
        assert KernelConfig.for_gpu("NVIDIA H200", config, dtype=torch.float32) == KernelConfig()
        d, inter = config.hidden_size, config.intermediate_size
        qkv = d + 2 * config.num_key_value_heads * (d // config.num_attention_heads)
        shapes = {(d, qkv), (d, d), (d, 2 * inter), (inter, d), (d, config.vocab_size)}
        if config.model_type == "phi":  # q, k, v and fc1 fused; dense and fc2 fused
            shapes = {(d, 3 * d + inter), (d + inter, d), (d, config.vocab_size)}
        assert set(h200.pdl_tiles.shapes()) == shapes, name
        for (k, _), entries in h200.pdl_tiles.entries:
            assert all(t is not None and t.fits(k) for _, t in entries)
    other = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)  # Llama-3-8B's widths
    assert KernelConfig.for_gpu("NVIDIA H200", other).pdl_rows == 0
    assert KernelConfig.for_gpu("NVIDIA H200", None).pdl_rows == 0


def _qkv_in_slices(model) -> TileTable:
    """A tile table whose q, k, v tile cuts K in two (the attention kernels
    then add the slices)."""
    cfg = model.config
    d, head = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    qkv = d + 2 * cfg.num_key_value_heads * head
    return TileTable({(d, qkv): ((64, Tile(16, 16, 2, 4, 3)),)})


@pytest.mark.parametrize("arch,sliced,chained", [
    ("phi", False, False), ("llama", False, False), ("qwen2", False, False),
    ("llama", True, False), ("qwen2", True, False), ("llama", False, True),
    ("qwen2", False, True)])
def test_the_dependent_steps_layers_compute_the_usual_step(arch, sliced, chained, monkeypatch):
    """The layer functions themselves, on the CPU, where every kernel has
    its torch stand-in: the norms over partial sums, the fused GEMMs' splits,
    the gated MLP as one output and the final norm give the usual step's
    logits (the kernels are checked against torch on the GPU, above).
    ``sliced``: q, k, v handed to attention as slices of sums; ``chained``:
    the layers without norm kernels (``pdl_step.chained_layer``)."""
    from tests.test_cuda_fused import backend, decode_logits
    model = tiny_model(arch, seed=7)
    with torch.no_grad():  # norms and biases of their own, so that mixing them up shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn_like(param))
    plain = backend(model)
    be = backend(model)
    decoder = be._runner.decoder
    decoder.dims = attrs.evolve(decoder.dims, pdl_rows=64,  # as a Hopper GPU would run it
                                pdl_tiles=_qkv_in_slices(model) if sliced else TileTable(),
                                norms_in_rows=64 if chained else 0)
    from bubblefree.cuda_backend import pdl_step
    chain, chained_seen = pdl_step.chained_layer, []
    monkeypatch.setattr(pdl_step, "chained_layer", lambda *a: chained_seen.append(1) or chain(*a))
    attend, dims_seen = pdl_step.attend, []
    monkeypatch.setattr(pdl_step, "attend", lambda q, *a, **kw: dims_seen.append(q.dim())
                        or attend(q, *a, **kw))
    assert decoder.dims.glu == (arch != "phi")
    torch.manual_seed(0)
    plain.cache.data.normal_()
    be.cache.data.copy_(plain.cache.data)
    got = decode_logits(be, decoder, [1, 6, 17, 9])
    want = decode_logits(plain, plain._runner.decoder, [1, 6, 17, 9])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(be.cache.data, plain.cache.data)  # the same keys and values written
    assert set(dims_seen) == {3 if sliced else 2}  # slices [S, B, N] went to attention
    assert len(chained_seen) == (model.config.num_hidden_layers if chained else 0)


def _split_case(pages: int, seed: int):
    """Three rows over ``pages`` pages of 4 each (the last one's query near
    its end), four query heads over two KV heads of 64, on the GPU: q, keys,
    values, the page table and the positions."""
    torch.manual_seed(seed)
    b, h, kvh, d, ps, n = 3, 4, 2, 64, 4, pages + 64
    dev = dict(device="cuda")
    keys, values = torch.randn(n * ps, kvh, d, **dev), torch.randn(n * ps, kvh, d, **dev)
    table = torch.stack([torch.randperm(n - 1, **dev)[:pages] + 1 for _ in range(b)])
    positions = torch.tensor([5, 17, pages * ps - 9], **dev)
    return torch.randn(b, h, d, **dev), keys, values, table, positions


def _own_token(on: bool):
    """The step's own keys and values for ``_split_case``'s rows, or None."""
    from bubblefree.cuda_backend import paged_decode as pd
    if not on:
        return None
    g, dev = torch.Generator(device="cuda").manual_seed(1), dict(device="cuda")
    return pd.NewToken(torch.randn(3, 2, 64, generator=g, **dev), torch.randn(3, 2, 64, generator=g, **dev),
                       torch.randn(3, 32, generator=g, **dev), torch.randn(3, 32, generator=g, **dev),
                       torch.arange(3, **dev))


@PDL
@pytest.mark.parametrize("new_token", [False, True])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("pages", [12, 600])
def test_keys_read_before_the_wait_change_nothing(new_token, window, pages):
    """Dispatch.prefetch: the split kernel reads its first block of keys and
    values before it waits for q. Same outputs and cache, bit for bit, with
    one block per program and with several (600 pages of 4: 64-key chunks)."""
    from bubblefree.cuda_backend import paged_decode as pd
    from bubblefree.cuda_backend.kernel_config import Dispatch
    q, keys, values, table, positions = _split_case(pages, pages)
    outs = []
    for prefetch in (False, True):
        kc, vc = keys.clone(), values.clone()
        dispatch = Dispatch(split_below=1 << 30, prefetch=prefetch)
        out = pd.run(q, kc, vc, table, positions, 4, 0.125,
                     window if window is not None else pd.NO_WINDOW, dispatch,
                     new=_own_token(new_token), pdl=True)
        outs.append((out, kc, vc))
    (a, ka, va), (c, kc, vc) = outs
    assert torch.equal(a, c) and torch.equal(ka, kc) and torch.equal(va, vc)


@PDL
@pytest.mark.parametrize("new_token", [False, True])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("pages", [12, 600])
@pytest.mark.parametrize("act", [0, 1])
def test_the_last_programs_combining_changes_nothing(new_token, window, pages, act):
    """KernelConfig.last_combines: the split kernel's last program of each
    (row, head) combines, instead of combine_kernel. Same outputs, cache
    and activation, bit for bit, whichever program finishes last (600
    pages of 4: 38 programs a (row, head)); the counters are left zero.
    Each case runs eight times: a race would show as a difference."""
    from bubblefree.cuda_backend import paged_decode as pd
    q, keys, values, table, positions = _split_case(pages, pages + act)
    f = torch.randn(3, 40, device="cuda")
    counters = torch.zeros(3 * 4, dtype=torch.int32, device="cuda")
    outs = []
    for last in [False] + [True] * 8:
        kc, vc = keys.clone(), values.clone()
        rider = pd.Activation(f, torch.empty_like(f), act) if act else None
        out = torch.empty_like(q)
        pd.split_attention(q, kc, vc, table, positions, 4, 0.125,
                           window if window is not None else pd.NO_WINDOW, out,
                           _own_token(new_token), rider, pdl=True,
                           counters=counters if last else None)
        outs.append((out, kc, vc, rider.dst if rider else out))
    torch.cuda.synchronize()
    want = outs[0]
    for got in outs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(want, got))
    assert not counters.any()


@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
@pytest.mark.parametrize("combines", [1, 8])
def test_the_dependent_step_with_the_last_programs_combining_decodes_the_same_tokens(arch, combines):
    """In the buckets of up to ``last_combines`` rows (one prompt alone, and
    all four in a bucket of 4 where 8 rows combine, not where 1 does)."""
    from bubblefree.cuda_backend.kernel_config import Dispatch
    model = tiny_model(arch, device="cuda", seed=4)
    split = dict(pdl_rows=8, dispatch=Dispatch(split_below=1 << 30))  # the split kernel everywhere
    plain = _small(model, kernels=attrs.evolve(KernelConfig.measured("cuda"), last_combines=0,
                                               **split))
    kernels = attrs.evolve(KernelConfig.measured("cuda"), last_combines=combines, **split)
    be = _small(model, kernels=kernels)
    assert "dependent launches up to 8 rows" in be.decode_path
    assert f"last programs combining up to {combines} rows" in str(be.kernels)
    assert be._runner.decoder.dims.combine_rows == combines
    assert generate(be, PROMPTS, 10) == generate(plain, PROMPTS, 10)
    assert generate(be, PROMPTS[2:3], 10) == generate(plain, PROMPTS[2:3], 10)


@PDL
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_dependent_step_with_q_k_v_in_slices_decodes_the_same_tokens(arch):
    """The q, k, v projection cutting K (its sums added by the attention
    kernels): in graphs, greedy tokens equal the usual step's and
    transformers' generate."""
    from tests.test_cuda_gpu import reference
    model = tiny_model(arch, device="cuda", seed=4)
    first = reference(model, PROMPTS, 10)
    want = generate(_small(model, kernels=KernelConfig.measured("cuda")), PROMPTS, 10)
    kernels = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8,
                           pdl_tiles=_qkv_in_slices(model))
    assert generate(_small(model, kernels=kernels), PROMPTS, 10) == want == first


@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
def test_the_dependent_step_with_the_norms_releasing_early_decodes_the_same_tokens(arch):
    """KernelConfig.early_norms: the GEMM after each norm launched before
    the norm waits; in graphs, with the measured tiles and the split
    kernel's states, greedy tokens equal the step's without it, and a
    step's logits (four rows in a bucket of 8) are exactly its own."""
    model = tiny_model(arch, device="cuda", seed=4)
    base = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8, early_norms=0)
    plain = _small(model, kernels=base)
    be = _small(model, kernels=attrs.evolve(base, early_norms=8))
    assert "norms releasing the next kernel early up to 8 rows" in str(be.kernels)
    assert be._runner.decoder.dims.early_rows == 8
    assert_same_steps(be, plain, PROMPTS)


def _early_tiles(model, early: bool, vector: bool) -> TileTable:
    """Every GEMM of the dependent step in the vector form (``v``) or the
    MMA form reading two steps before its wait, letting the next kernel
    launch before it loads and waits where ``early``."""
    cfg = model.config
    d, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    qkv = (heads + 2 * kv) * hd
    shapes = ([(d, qkv + inter), (heads * hd + inter, d)] if cfg.model_type == "phi" else
              [(d, qkv), (heads * hd, d), (d, 2 * inter), (inter, d)])
    tile = (Tile(16, 16, 1, 4, 1, vector=1, early=int(early)) if vector else
            Tile(16, 16, 1, 4, 3, 2, early=int(early)))
    return TileTable({shape: ((8, tile),) for shape in [*shapes, (d, vocab)]})


@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
@pytest.mark.parametrize("vector", [True, False])
def test_the_dependent_step_whose_gemms_release_early_decodes_the_same_tokens(arch, vector):
    """Every GEMM, in the vector form or the MMA form, letting the next
    kernel launch before it loads its weights and waits (a tile's ``e``),
    with the norms releasing early too, so that kernels several deep are
    placed at once: in graphs, greedy tokens equal the same tiles' without
    the release, and a step's logits are exactly theirs (bfloat16: the
    vector form's weights are 16-bit)."""
    model = tiny_model(arch, device="cuda", seed=4, dtype=torch.bfloat16)
    base = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8, early_norms=8)
    plain = _small(model, kernels=attrs.evolve(base, pdl_tiles=_early_tiles(model, False, vector)))
    be = _small(model, kernels=attrs.evolve(base, pdl_tiles=_early_tiles(model, True, vector)))
    cfg = model.config
    assert be.kernels.pdl_tiles.tile_for(1, cfg.hidden_size, cfg.vocab_size).early == 1
    assert_same_steps(be, plain, PROMPTS)


def assert_same_steps(be, plain, prompts) -> None:
    """Two backends of one model: greedy tokens equal in graphs, and a
    step of four rows in a bucket of 8 over the same random cache gives
    the same logits, bit for bit."""
    from tests.test_cuda_fused import decode_logits
    assert generate(be, prompts, 10) == generate(plain, prompts, 10)
    torch.manual_seed(0)
    plain.cache.data.normal_()
    be.cache.data.copy_(plain.cache.data)
    assert torch.equal(decode_logits(be, be._runner.decoder, [1, 6, 17, 9]),
                       decode_logits(plain, plain._runner.decoder, [1, 6, 17, 9]))


@PDL
def test_the_dependent_step_with_keys_read_early_decodes_the_same_tokens():
    model = tiny_model("phi", device="cuda", seed=4)
    want = generate(_small(model, kernels=KernelConfig.measured("cuda")), PROMPTS, 10)
    base = KernelConfig.measured("cuda")
    kernels = attrs.evolve(base, pdl_rows=8, dispatch=attrs.evolve(base.dispatch, prefetch=True))
    assert generate(_small(model, kernels=kernels), PROMPTS, 10) == want


@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
@pytest.mark.parametrize("launch", [dict(split_block=16, split_warps=1),
                                    dict(split_block=64, split_warps=4, max_splits=2)])
def test_the_dependent_step_with_the_split_kernel_launched_otherwise_decodes_the_same_tokens(
        arch, launch):
    """Dispatch.split_block, split_warps and max_splits change the split
    kernel's launch, not what it computes: in graphs, with the split kernel
    everywhere (and the projection combining its states where the measured
    defaults say so), greedy tokens equal the default launch's."""
    from bubblefree.cuda_backend.kernel_config import Dispatch
    model = tiny_model(arch, device="cuda", seed=4)
    prompts = [*PROMPTS, [3] * 40]
    base = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8, o_combines=1,
                        dispatch=Dispatch(split_below=1 << 30))
    want = generate(_small(model, kernels=base), prompts, 10)
    be = _small(model, kernels=attrs.evolve(base, dispatch=attrs.evolve(base.dispatch, **launch)))
    assert "keys an iteration" in str(be.kernels)
    assert generate(be, prompts, 10) == want
