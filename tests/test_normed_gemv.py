"""Llama's and Qwen2's layers without norm kernels (``KernelConfig.norms_in``,
cuda_backend/normed_gemv.py, ``pdl_step.chained_layer``): K's two loads,
the launches chosen, the errors; compiled for sm_90 here, the weights all
asked for before the wait; on a GPU the kernel against torch and whole
steps against the step with its norms. The GPU cases are skipped, with
the reason, where there is no CUDA."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubblefree.cuda_backend import normed_gemv, pdl
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.measured import LLAMA_32_1B, QWEN2_05B
from bubblefree.cuda_backend.normed_gemv import Launch, choose, torch_run, values, widths
from bubblefree.cuda_backend.tiny import tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton kernels")
PDL = pytest.mark.skipif(not pdl.supported("cuda"),
                         reason="needs a GPU of compute capability 9 or later and Triton")
LAUNCHES = [False, pytest.param(True, marks=PDL)]
PROMPTS = [[5, 9, 17, 33, 4], [7, 8], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2], [11] * 30]


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@given(k=st.integers(1, 1 << 16))
def test_k_is_read_whole_in_two_loads_of_powers_of_two(k):
    first, rest = widths(k)
    assert _power_of_two(first) and _power_of_two(rest) and rest >= 16
    assert first <= k <= first + rest  # the first load unmasked, the second covers the rest
    assert first + rest < max(2 * k, k + 32)  # never the doubling one rounded-up load costs


def test_qwen2s_widths_hold_far_less_than_one_load_would():
    assert widths(896) == (512, 512)
    assert widths(4864) == (4096, 1024)  # 5,120 values of registers, not 8,192
    assert widths(2048) == (2048, 16)  # a power of two: the second load masked whole


@pytest.mark.parametrize("shape", [QWEN2_05B, LLAMA_32_1B])
def test_a_chosen_launch_holds_at_most_half_a_threads_share_and_covers_the_gpu(shape):
    _, d, inter, heads, kv, _ = shape
    qkv = d + 2 * kv * d // heads
    for k, n, glu in [(d, qkv, False), (d, d, False), (d, inter, True), (inter, d, False)]:
        launch = choose(k, n, glu, 132)
        assert values(k, launch, glu) <= 128, (k, n, launch)
        assert -(-n // launch.block_n) >= 2 * 132 or launch.block_n == 1, (k, n, launch)
        assert launch.early


def _layer(d: int, inter: int, qkv: int):
    """A layer's weights as ``chained_layer`` takes them, shapes only."""
    w = lambda n, k: torch.empty((n, k), device="meta", dtype=torch.bfloat16)  # noqa: E731
    return (None, w(qkv, d), None, w(d, d), None, None, w(2 * inter, d), None, w(d, inter), None)


@pytest.mark.parametrize("shape", [QWEN2_05B, LLAMA_32_1B])
def test_the_measured_shapes_can_run_without_norms_up_to_eight_rows(shape):
    from bubblefree.cuda_backend.fused_layers import Dims
    from bubblefree.cuda_backend.pdl_step import chainable
    _, d, inter, heads, kv, _ = shape
    tiles = KernelConfig.for_gpu("NVIDIA H200", _config(shape)).pdl_tiles
    layer = _layer(d, inter, d + 2 * kv * d // heads)
    at = Dims(heads=heads, kv_heads=kv, head_dim=d // heads, eps=1e-6, scaling=1.0, split=(),
              inter=inter, pdl_tiles=tiles, glu=True)
    assert chainable(layer, at, 8)
    assert not chainable(layer, at, 9)  # past the rows the kernel unrolls


def test_a_layer_too_wide_for_a_threads_registers_keeps_its_norms():
    """A model far wider than the measured ones: no launch holds its
    down projection's K in a thread's share, so the layers keep their norm
    kernels rather than fail when the step is captured."""
    from bubblefree.cuda_backend.fused_layers import Dims
    from bubblefree.cuda_backend.pdl_step import chainable
    at = Dims(heads=8, kv_heads=8, head_dim=128, eps=1e-6, scaling=1.0, split=(), inter=100_000,
              glu=True)
    assert not chainable(_layer(1024, 100_000, 3072), at, 1)
    assert chainable(_layer(1024, 4096, 3072), at, 1)


def _config(shape):
    from bubblefree.bench.speed_setup import SHAPES
    name = {QWEN2_05B: "qwen05b", LLAMA_32_1B: "llama1b"}[shape]
    return SHAPES[name]["config"]()


def _inputs(m, k, n, dtype, device, glu=False):
    torch.manual_seed(m * 31 + k)
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = (torch.randn(2 * n if glu else n, k, device=device, dtype=dtype) / k ** 0.5)
    bias = torch.randn(w.shape[0], device=device, dtype=dtype)
    norm = (1 + 0.3 * torch.randn(k, device=device)).to(dtype)
    residual = torch.randn(m, n, device=device, dtype=dtype)
    return x, w, bias, norm, residual


@pytest.mark.parametrize("bad,match", [
    (dict(rows=9), "at most 8 rows, not 9"),
    (dict(dtype=torch.float32), "16-bit weights"),
    (dict(launch=Launch(64, 1)), "64 columns a program in 1 warp would hold 2048 weights a thread for K=896"),
    (dict(norm=torch.ones(5)), r"norm's weight must be \[896\], not \(5,\)"),
    (dict(residual=torch.ones(2, 3)), r"residual must be \[1, 64\], not \(2, 3\)"),
])
def test_what_cannot_run_is_named(bad, match):
    x, w, _, _, _ = _inputs(bad.get("rows", 1), 896, 64, bad.get("dtype", torch.bfloat16),
                            "cpu")
    with pytest.raises(ValueError, match=match):
        normed_gemv.check(x, w, bad.get("launch", Launch(4, 1)), glu=False,
                          norm=bad.get("norm"), residual=bad.get("residual"))


def test_w_that_does_not_take_x_is_named():
    x, w, _, _, _ = _inputs(1, 896, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"w \(64, 512\) does not take x \(1, 896\)"):
        normed_gemv.check(x, w[:, :512], Launch(4, 1), glu=False, norm=None, residual=None)
    with pytest.raises(ValueError, match=r"as \[gate; up\]"):
        normed_gemv.check(x, w[:63], Launch(4, 1), glu=True, norm=None, residual=None)


def test_norms_in_is_a_row_count_and_says_itself():
    with pytest.raises(ValueError, match="norms_in is a row count"):
        KernelConfig(norms_in=-1)
    with pytest.raises(ValueError, match="norms_in is a row count"):
        KernelConfig(norms_in=True)
    said = str(KernelConfig(pdl_rows=8, norms_in=1))
    assert "Llama's and Qwen2's layers without norm kernels at one row" in said
    assert "without norm kernels" not in str(KernelConfig(norms_in=1))  # no dependent step


def test_off_a_gpu_it_is_torchs_and_rounds_as_the_norm_kernel_does():
    """Where Triton does not run (the CPU), ``run`` is ``torch_run``: the
    norm as ``add_norm`` rounds it, the projection, the gated MLP, the
    residual added in x's dtype."""
    from bubblefree.cuda_backend.add_norm import rms_norm
    x, w, bias, norm, residual = _inputs(3, 96, 40, torch.bfloat16, "cpu", glu=True)
    got = normed_gemv.run(x, w, bias, Launch(4, 1), norm=norm, eps=1e-6, residual=residual,
                          glu=True)
    gate, up = torch.nn.functional.linear(rms_norm(x, norm, 1e-6), w, bias).chunk(2, dim=-1)
    assert torch.equal(got, residual + torch.nn.functional.silu(gate) * up)


# --- compiled for sm_90, no GPU needed ------------------------------------

ARGS = {"x_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
        "r_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "eps": "fp32",
        "sx_m": "i32", "sw_n": "i32", "sr_m": "i32", "so_m": "i32", "up_off": "i32"}


def _compiled(consts: dict, warps: int):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(ARGS)
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in ARGS if a != "eps"}
    signature = {**ARGS, **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(fn=normed_gemv._normed_gemv_kernel, signature=signature,
                       constexprs=consts, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps))


@pytest.mark.parametrize("form", ["norm", "glu", "resid"])
@pytest.mark.parametrize("early", [False, True])
def test_every_weight_is_asked_for_before_the_wait(form, early):
    """Launched dependent: the weights (and the norm's) are loaded before
    ``griddepcontrol.wait``, 16 bytes at a time; the release comes first
    with ``early``, else after the wait; no store before the wait (the
    rule of ``cuda_backend.pdl``)."""
    k1, k2 = widths(896)
    kernel = _compiled(dict(K=896, NORM=form != "resid", RESID=form == "resid", HAS_BIAS=True,
                            GLU=form == "glu", PDL=True, BLOCK_N=8, K1=k1, K2=k2, ROWS=1,
                            EARLY=early), warps=2)
    ptx = kernel.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    release = ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == ptx.count("griddepcontrol.wait") == 1
    assert (release < ptx.index("ld.global")) == early and (release < wait) == early
    before = ptx[:wait]
    # 8 columns by 1,024 of K in 64 threads: 128 values a thread, 16 loads of 16 bytes
    # (twice for gate and up)
    assert before.count("ld.global.v4.b32") >= 16 * (2 if form == "glu" else 1)
    assert "st.global" not in before


@pytest.mark.parametrize("k,launch", [(896, Launch(2, 1)), (896, Launch(8, 4)),
                                      (4864, Launch(2, 4)), (8192, Launch(2, 8))])
def test_the_residual_is_asked_for_before_any_sum(k, launch):
    """After the wait an output projection asks for the residual it adds
    (its 2-byte loads, or one 4-byte load of a program's two columns, as
    Triton 3.9 merges them) before its first sum across threads, not
    behind the sums: an L2 round trip off the step's path."""
    k1, k2 = widths(k)
    ptx = _compiled(dict(K=k, NORM=False, RESID=True, HAS_BIAS=False, GLU=False, PDL=True,
                         BLOCK_N=launch.block_n, K1=k1, K2=k2, ROWS=1, EARLY=True),
                    warps=launch.warps).asm["ptx"]
    after = ptx[ptx.index("griddepcontrol.wait"):]
    first_sum = min(after.index(op) for op in ("shfl.sync", "bar.sync") if op in after)
    residual = "ld.global.b16" if "ld.global.b16" in after else "ld.global.b32"
    assert 0 <= after.index(residual) < first_sum


@pytest.mark.parametrize("shape", [QWEN2_05B, LLAMA_32_1B])
def test_the_chosen_launches_of_the_measured_shapes_compile_without_spilling(shape):
    _, d, inter, heads, kv, _ = shape
    qkv = d + 2 * kv * d // heads
    for k, n, form in [(d, qkv, "norm"), (d, d, "resid"), (d, inter, "glu"), (inter, d, "resid")]:
        launch = choose(k, n, form == "glu", 132)
        k1, k2 = widths(k)
        kernel = _compiled(dict(K=k, NORM=form != "resid", RESID=form == "resid", HAS_BIAS=True,
                                GLU=form == "glu", PDL=True, BLOCK_N=launch.block_n, K1=k1,
                                K2=k2, ROWS=1, EARLY=True), warps=launch.warps)
        assert "local" not in kernel.asm["ptx"].split("griddepcontrol.wait")[0], (k, n, launch)


# --- on a GPU -------------------------------------------------------------

@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 896, 1152), (3, 896, 896), (8, 4864, 896), (1, 64, 40),
                                   (2, 2048, 96)])
@pytest.mark.parametrize("launch_pdl,early", [(False, False), pytest.param(True, False, marks=PDL),
                                              pytest.param(True, True, marks=PDL)])
def test_the_kernel_matches_torch(m, k, n, dtype, launch_pdl, early):
    """The norm in, the bias, the gated MLP, the residual added: each
    against ``torch_run`` (the sums in another order: to 16-bit rounding)."""
    x, w, bias, norm, residual = _inputs(m, k, n, dtype, "cuda", glu=True)
    launch = attrs.evolve(choose(k, n, True, 132), early=early)

    def close(got, want):
        assert got.shape == want.shape and got.dtype == want.dtype
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, err

    for kw in [dict(norm=norm, eps=1e-6), dict(residual=residual[:, :n]), {}]:
        one = w[:n]
        close(normed_gemv.run(x, one, bias[:n], launch, pdl=launch_pdl, **kw),
              torch_run(x, one, bias[:n], **kw))
    close(normed_gemv.run(x, w, bias, launch, norm=norm, eps=1e-6, glu=True, pdl=launch_pdl),
          torch_run(x, w, bias, norm=norm, eps=1e-6, glu=True))
    close(normed_gemv.run(x, w, None, launch, norm=norm, eps=1e-6, glu=True, pdl=launch_pdl),
          torch_run(x, w, None, norm=norm, eps=1e-6, glu=True))


@PDL
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows,last_combines", [(1, 0), (8, 8)])
def test_the_step_without_norm_kernels_decodes_the_same_tokens(arch, rows, last_combines):
    """In graphs, the buckets of at most ``rows`` rows without norm kernels
    (the split attention kernel's states combined by its own kernel, or by
    its last programs): greedy tokens equal the step's with its norms (of
    as many prompts as those buckets hold), and a step's logits are its to
    16-bit rounding. In bfloat16 neither is transformers' own generate,
    whose sums round elsewhere (a float32 model keeps its norms, below)."""
    from tests.test_cuda_fused import decode_logits
    from tests.test_pdl_step import _small
    model = tiny_model(arch, device="cuda", seed=4, dtype=torch.bfloat16)
    base = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8, last_combines=last_combines)
    plain = _small(model, kernels=base)
    be = _small(model, kernels=attrs.evolve(base, norms_in=rows))
    assert be._runner.decoder.dims.norms_in_rows == rows
    assert plain._runner.decoder.dims.norms_in_rows == 0
    prompts = PROMPTS[:rows]
    assert generate(be, prompts, 10) == generate(plain, prompts, 10)
    torch.manual_seed(0)
    plain.cache.data.normal_()
    be.cache.data.copy_(plain.cache.data)
    got = decode_logits(be, be._runner.decoder, [1, 6, 17, 9][:rows], padded=rows)
    want = decode_logits(plain, plain._runner.decoder, [1, 6, 17, 9][:rows], padded=rows)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err


@PDL
def test_a_float32_model_keeps_its_norm_kernels():
    """The kernel holds 16-bit weights only: a float32 model asked for it
    runs the layers with their norms."""
    from tests.test_pdl_step import _small
    model = tiny_model("qwen2", device="cuda", seed=4)
    be = _small(model, kernels=attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8,
                                            norms_in=8))
    assert be._runner.decoder.dims.norms_in_rows == 0
