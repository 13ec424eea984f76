"""A decode step's inputs gathered in one kernel (``cuda_backend.step_inputs``):
the rows' embeddings (or a value's encoding where a row's flag is set),
their KV slots through the page tables, and rotary values read from tables
the model's own module computed, equal bit for bit to what torch computed
per step before. The torch path is checked on the CPU against the model's
modules; the kernel against the torch path on the GPU."""

from __future__ import annotations

import attrs
import pytest
import torch

from bubblefree.cuda_backend import normed_gemv, pdl
from bubblefree.cuda_backend.attention import decode_context
from bubblefree.cuda_backend.graphs import GraphSet
from bubblefree.cuda_backend.kernel_config import Dispatch, KernelConfig
from bubblefree.cuda_backend.step_inputs import RopeTable, step_inputs, torch_step_inputs
from bubblefree.cuda_backend.tiny import tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a Triton kernel")


def case(model, b: int, seqs: int, pages: int, page_size: int, device, seed: int = 0):
    """Row slots, positions (0 and the last included), page tables, the
    sampled tokens per row slot, value flags and encodings."""
    g = torch.Generator().manual_seed(seed)
    vocab, dim = model.config.vocab_size, model.config.hidden_size
    row_slots = torch.randperm(seqs, generator=g)[:b]
    positions = torch.randint(0, pages * page_size, (b,), generator=g)
    positions[0] = pages * page_size - 1
    if b > 1:
        positions[1] = 0
    page_table = torch.randint(0, 97, (b, pages), generator=g)
    last_token = torch.randint(0, vocab, (seqs,), generator=g)
    flags = torch.rand(seqs, generator=g) > 0.5
    values = torch.randn(seqs, dim, generator=g)
    return [t.to(device) for t in (row_slots, positions, page_table, last_token, flags, values)]


@pytest.mark.parametrize("arch", ["llama", "phi", "qwen2"])
def test_the_torch_path_is_what_the_step_computed_per_step(arch):
    model = tiny_model(arch, seed=3)
    rotary, embed = model.model.rotary_emb, model.model.embed_tokens
    page_size, pages = 4, 8
    rope = RopeTable.of(rotary, pages * page_size, embed.weight.dtype, embed.weight.device)
    row_slots, positions, page_table, last_token, flags, values = case(model, 5, 9, pages, page_size,
                                                                       "cpu")
    for with_values in (False, True):
        got = torch_step_inputs(row_slots, positions, page_table, last_token, embed.weight, rope,
                                page_size, *((flags, values) if with_values else ()))
        x = embed(last_token[row_slots])
        if with_values:
            x = torch.where(flags[row_slots].unsqueeze(1), values[row_slots], x)
        assert torch.equal(got.x, x)
        cos, sin = rotary(x, positions.view(1, -1))
        assert torch.equal(got.cos, cos[0]) and torch.equal(got.sin, sin[0])

        class Cache:  # what decode_context reads of a cache
            pass
        cache = Cache()
        cache.page_size = page_size
        ctx = decode_context(cache, positions, page_table, Dispatch())
        assert torch.equal(got.slot_mapping, ctx.slot_mapping)
        want = [int(page_table[i, p // page_size]) * page_size + int(p) % page_size
                for i, p in enumerate(positions.tolist())]
        assert got.slot_mapping.tolist() == want


def test_a_rope_table_grows_to_the_positions_asked_and_is_off_when_inputs_are_not_gathered():
    from bubblefree.cuda_backend.fused_decode import FusedDecoder
    model = tiny_model("llama", seed=1)
    decoder = FusedDecoder(model, KernelConfig())
    assert len(decoder.rope_table(16)) == 16
    assert len(decoder.rope_table(8)) == 16  # a shorter ask keeps the table
    assert len(decoder.rope_table(40)) == 40
    off = FusedDecoder(model, attrs.evolve(KernelConfig(), step_inputs=False))
    assert off.rope_table(16) is None
    assert "step inputs in torch" in str(attrs.evolve(KernelConfig(), step_inputs=False))


@pytest.mark.parametrize("arch", ["llama", "phi"])
def test_a_backend_decodes_the_same_with_gathered_inputs_and_without(arch):
    """On the CPU both run torch's ops: the runner's step over gathered
    inputs gives the per-step path's logits and keys, bit for bit."""
    from tests.test_cuda_fused import backend, decode_logits
    model = tiny_model(arch, seed=7)
    be = backend(model)
    assert be._runner.rope is not None
    torch.manual_seed(0)
    be.cache.data.normal_()
    lens = [1, 6, 17, 9]
    per_step = decode_logits(be, be._runner.decoder, lens)  # also packs the step's metadata
    cache = be.cache.data.clone()
    with torch.no_grad():
        gathered = be._runner.decode_forward(8, 16)[:len(lens)]  # decode_logits' bucket
    assert torch.equal(gathered, per_step) and torch.equal(be.cache.data, cache)
    off = backend(model, kernels=attrs.evolve(KernelConfig(), step_inputs=False))
    assert off._runner.rope is None


# -- the kernel, on the GPU -------------------------------------------------------------------


PDL = pytest.mark.skipif(not torch.cuda.is_available() or not pdl.supported("cuda"),
                         reason="needs a GPU with dependent launches (Hopper)")


@CUDA
@pytest.mark.parametrize("arch", ["llama", "phi"])
@pytest.mark.parametrize("b", [1, 3, 8, 64])
@pytest.mark.parametrize("release", [False, pytest.param(True, marks=PDL)])
def test_the_kernel_matches_the_torch_path(arch, b, release):
    model = tiny_model(arch, seed=5, dtype=torch.bfloat16, device="cuda")
    embed = model.model.embed_tokens.weight
    page_size, pages = 16, 12
    rope = RopeTable.of(model.model.rotary_emb, pages * page_size, embed.dtype, embed.device)
    row_slots, positions, page_table, last_token, flags, values = case(
        model, b, b + 5, pages, page_size, "cuda", seed=b)
    values = values.to(embed.dtype)
    for extra in ((), (flags, values)):
        got = step_inputs(row_slots, positions, page_table, last_token, embed, rope, page_size,
                          *extra, pdl=release)
        want = torch_step_inputs(row_slots, positions, page_table, last_token, embed, rope,
                                 page_size, *extra)
        for name in ("x", "slot_mapping", "cos", "sin"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@CUDA
@pytest.mark.parametrize("arch", ["llama", "phi", "qwen2"])
def test_the_table_holds_the_rotary_modules_values_on_the_gpu(arch):
    model = tiny_model(arch, seed=2, dtype=torch.bfloat16, device="cuda")
    rotary = model.model.rotary_emb
    rope = RopeTable.of(rotary, 4096, torch.bfloat16, torch.device("cuda"))
    positions = torch.tensor([0, 1, 77, 1023, 2048, 4095], device="cuda")
    cos, sin = rotary(torch.zeros(1, dtype=torch.bfloat16, device="cuda"), positions.view(1, -1))
    assert torch.equal(rope.cos[positions], cos[0]) and torch.equal(rope.sin[positions], sin[0])


@CUDA
@pytest.mark.parametrize("arch", ["llama", "phi"])
def test_a_gpu_backend_gives_the_same_tokens_with_gathered_inputs_and_without(arch):
    from bubblefree.cuda_backend.backend import CudaBackend
    from bubblefree.cuda_backend.drive import generate

    prompts = [[1, 5, 9, 2], [3, 3, 3], [7] * 20]
    runs = []
    for on in (True, False):
        model = tiny_model(arch, device="cuda", seed=5, dtype=torch.bfloat16)
        kernels = attrs.evolve(KernelConfig.measured("cuda", model.config), step_inputs=on)
        backend = CudaBackend(model, max_rows=8, max_seqs=8, num_pages=64, kernels=kernels)
        assert (backend._runner.rope is not None) == on
        runs.append(generate(backend, prompts, 12))
    assert runs[0] == runs[1]


@PDL
@pytest.mark.parametrize("b", [1, 8])
def test_the_layer_launched_as_the_kernel_starts_reads_the_inputs_it_gathered(b):
    """The first layer's GEMM, launched dependent on the kernel that lets
    it launch as it starts, normed from the gathered embeddings: replayed
    in a graph with new tokens each time, it equals the same GEMM over the
    torch path's embeddings."""
    model = tiny_model("llama", seed=7, dtype=torch.bfloat16, device="cuda")
    embed = model.model.embed_tokens.weight
    page_size, pages = 16, 4
    rope = RopeTable.of(model.model.rotary_emb, pages * page_size, embed.dtype, embed.device)
    row_slots, positions, page_table, last_token, _, _ = case(model, b, b + 3, pages, page_size,
                                                              "cuda", seed=b)
    d = embed.shape[1]
    g = torch.Generator().manual_seed(b)
    w = (torch.randn(3 * d, d, generator=g) / 8).to(torch.bfloat16).cuda()
    norm = torch.rand(d, generator=g).to(torch.bfloat16).cuda()
    launch = normed_gemv.choose(d, 3 * d, False, 132)
    out = {}

    def step():
        got = step_inputs(row_slots, positions, page_table, last_token, embed, rope, page_size,
                          pdl=True)
        out["y"] = normed_gemv.run(got.x, w, None, launch, norm=norm, eps=1e-6, pdl=True)

    graphs = GraphSet(torch.device("cuda"), True)
    graphs.capture("step", step)  # warmed up on a side stream, then recorded
    for i in range(4):
        last_token.copy_(torch.randint(0, embed.shape[0], last_token.shape, generator=g))
        graphs.run("step", step)
        x = torch_step_inputs(row_slots, positions, page_table, last_token, embed, rope,
                              page_size).x
        want = normed_gemv.run(x, w, None, launch, norm=norm, eps=1e-6)
        assert torch.equal(out["y"], want), i
