"""A sequential layer's second half as one persistent kernel
(cuda_backend/layer_mlp.py): its torch reference against the per-kernel
step's rounding, its checks, and where Triton runs (a GPU, or Triton's
interpreter with ``TRITON_INTERPRET=1``) the kernels against it: the three
phases launched one by one, the persistent kernel (under the interpreter
with one program, whose waits pass at once), and on a GPU whole steps'
tokens with it on. Skipped, with the reason, where neither runs."""

from __future__ import annotations

import os

import attrs
import pytest
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend import layer_mlp, pdl
from bubblefree.cuda_backend.add_norm import torch_add_norm
from bubblefree.cuda_backend.kernel_config import KernelConfig

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and layer_mlp.triton is not None
KERNELS = pytest.mark.skipif(not (CUDA or INTERPRETED),
                             reason="needs CUDA (or Triton's interpreter): Triton kernels")
DEVICE = "cuda" if CUDA else "cpu"
PDL = pytest.mark.skipif(not pdl.supported("cuda"),
                         reason="needs a GPU of compute capability 9 or later and Triton: "
                                "dependent launches in CUDA graphs")
# Triton's interpreter has no bfloat16 dot: half precision there.
DTYPE = torch.bfloat16 if CUDA else torch.float16


def weights(m, n, ko, inter, bias, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    return dict(x=r(m, n), a=r(m, ko), w_o=r(n, ko, scale=ko ** -0.5),
                b_o=r(n) if bias else None, norm_w=r(n), eps=1e-6,
                w_gu=r(2 * inter, n, scale=n ** -0.5), b_gu=r(2 * inter) if bias else None,
                w_down=r(n, inter, scale=inter ** -0.5), b_down=r(n) if bias else None)


@pytest.mark.parametrize("bias", [False, True])
def test_the_reference_rounds_as_the_per_kernel_step_does(bias):
    """h1 is ``add_norm``'s residual of o's float32 sums (rounded to the
    stream's dtype, then added); the norm is ``add_norm``'s; the GLU rounds
    gate, silu and the product as torch's ops do in the model's dtype."""
    w = weights(3, 48, 40, 72, bias)
    h1, sums = layer_mlp.torch_mlp_block(**w)
    o = F.linear(w["a"].float(), w["w_o"].float(), None if not bias else w["b_o"].float())
    want_h1, h = torch_add_norm(w["x"], o.unsqueeze(0), w["norm_w"], None, w["eps"], rms=True)
    assert torch.equal(h1, want_h1)
    gate, up = F.linear(h.float(), w["w_gu"].float(),
                        None if not bias else w["b_gu"].float()).to(h.dtype).chunk(2, dim=-1)
    act = F.silu(gate) * up
    want = F.linear(act.float(), w["w_down"].float(), None if not bias else w["b_down"].float())
    assert sums.shape == (1, 3, 48) and sums.dtype == torch.float32
    torch.testing.assert_close(sums[0], want, rtol=2e-2, atol=2e-2)


def test_without_triton_on_the_device_it_is_the_reference():
    w = weights(2, 32, 32, 40, True)
    got = layer_mlp.mlp_block(**w, sync=None, programs=4)
    want = layer_mlp.torch_mlp_block(**w)
    assert all(torch.equal(g, t) for g, t in zip(got, want))


@pytest.mark.parametrize("change, words", [
    (dict(w_o=torch.zeros(32, 31)), "do not chain"),
    (dict(w_gu=torch.zeros(79, 32)), "do not chain"),
    (dict(norm_w=torch.zeros(31)), "do not chain"),
    (dict(x=torch.zeros(17, 32), a=torch.zeros(17, 32)), "at most 16 rows"),
    (dict(a=torch.zeros(32, 2).t()), "contiguous"),
])
def test_inputs_that_do_not_chain_are_refused_by_name(change, words):
    w = weights(2, 32, 32, 40, False, dtype=torch.float32)
    w.update(change)
    with pytest.raises(ValueError, match=words):
        layer_mlp.mlp_block(**w, sync=None, programs=4)


def test_the_config_takes_a_row_count_and_says_where_it_is_on():
    assert KernelConfig().mlp_rows == 0
    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="mlp_rows is a row count"):
            KernelConfig(mlp_rows=bad)
    on = KernelConfig(pdl_rows=8, mlp_rows=4)
    assert "a layer's second half in one persistent kernel up to 4 rows" in str(on)
    assert "persistent" not in str(KernelConfig(pdl_rows=8))
    from bubblefree.bench.step_ab import variant  # bench.step_ab's and bench.speed's --variant
    assert variant(KernelConfig(pdl_rows=8), "mlp_rows=4").mlp_rows == 4


@KERNELS
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape, programs", [((64, 48, 96), 3), ((40, 40, 200), 5), ((40, 40, 70), 50)])
def test_the_phases_launched_one_by_one_compute_the_reference(m, bias, shape, programs):
    """Columns cut unevenly over the programs, K and the MLP's width not
    steps of the kernel's K (128), more programs than columns (a tiny
    model on a GPU of 132 multiprocessors: some programs own none, and
    still wait with the others): every mask is exercised."""
    n, ko, inter = shape
    w = weights(m, n, ko, inter, bias, DTYPE, DEVICE)
    h1, sums = layer_mlp.launch(**w, sync=None, programs=programs, persistent=False, pdl=False)
    want_h1, want = layer_mlp.torch_mlp_block(**w)
    assert torch.equal(h1, want_h1)
    torch.testing.assert_close(sums, want, rtol=1e-2, atol=1e-2)


@KERNELS
@pytest.mark.parametrize("persistent", [False, True])
def test_float32_is_computed_at_full_precision(persistent):
    """A float32 model's sums at float32's precision, not TensorFloat-32's
    (whose 10-bit mantissa would show at 1e-3): as ``skinny_gemm`` and
    cuBLAS compute them, so its greedy tokens stay the usual step's."""
    w = weights(3, 64, 48, 160, True, torch.float32, DEVICE)
    got = layer_mlp.launch(**w, sync=layer_mlp.new_sync(DEVICE), programs=1 if not CUDA else 6,
                           persistent=persistent, pdl=False)
    want = layer_mlp.torch_mlp_block(**w)
    for g, t in zip(got, want):
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)


@KERNELS
@pytest.mark.parametrize("bias", [False, True])
def test_the_persistent_kernel_is_its_phases_and_leaves_its_counters_at_zero(bias):
    """Each phase's programs run the same code either way: the results are
    the phases' bit for bit. Its two waits leave their counts at zero and
    move their generations on once a launch."""
    programs = 1 if not CUDA else 6  # the interpreter runs programs one after another
    w = weights(2, 64, 48, 160, bias, DTYPE, DEVICE)
    sync = layer_mlp.new_sync(DEVICE)
    phased = layer_mlp.launch(**w, sync=None, programs=programs, persistent=False, pdl=False)
    for launches in range(1, 4):
        got = layer_mlp.launch(**w, sync=sync, programs=programs, persistent=True, pdl=False)
        assert all(torch.equal(g, p) for g, p in zip(got, phased))
        assert sync.tolist() == [0, launches, 0, launches]


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the grid-wide waits of many programs")
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_on_a_gpu_the_persistent_kernel_at_qwen2s_shape_matches_the_reference(m):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = weights(m, 896, 896, 4864, True, torch.bfloat16, "cuda")
    sync = layer_mlp.new_sync("cuda")
    got = layer_mlp.mlp_block(**w, sync=sync, programs=sms)
    phased = layer_mlp.mlp_block(**w, sync=None, programs=sms, persistent=False)
    want_h1, want = layer_mlp.torch_mlp_block(**w)
    assert all(torch.equal(g, p) for g, p in zip(got, phased))
    assert torch.equal(got[0], want_h1)
    torch.testing.assert_close(got[1], want, rtol=2e-2, atol=2e-2)
    assert sync.tolist()[0::2] == [0, 0]


@PDL
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_step_with_the_persistent_kernel_decodes_the_same_tokens(arch, monkeypatch):
    """Captured in CUDA graphs, the dependent step with each layer's second
    half in one persistent kernel decodes the usual step's greedy tokens,
    and the kernel did run."""
    from bubblefree.cuda_backend.drive import generate
    from bubblefree.cuda_backend.tiny import tiny_model
    from tests.test_pdl_step import PROMPTS, _small
    calls = []
    real = layer_mlp.mlp_block
    monkeypatch.setattr(layer_mlp, "mlp_block", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_model(arch, device="cuda", seed=4)
    want = generate(_small(model, kernels=KernelConfig.measured("cuda")), PROMPTS, 10)
    be = _small(model, kernels=attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8, mlp_rows=8))
    assert be._decode_graphs.enabled and be._runner.decoder.dims.mlp_rows == 8
    assert generate(be, PROMPTS, 10) == want
    assert calls
