"""The fused decode step (cuda_backend/fused_decode.py) against transformers'
forward, on tiny random decoders on the CPU: same logits to rounding, same
greedy tokens, no weight stored twice, transformers' own forward unchanged,
and a clear fallback for models it does not cover."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bubblefree.core.values import SamplePlan, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.drive import generate, scattered_pages
from bubblefree.cuda_backend.fused_decode import FusedDecoder, TransformersDecoder, make_decoder
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.runner import staging_size
from bubblefree.cuda_backend.tiny import tiny_model

ARCHS = ["llama", "phi", "qwen2"]
PROMPTS = [[5, 9, 17, 33, 4], [7, 8], [11, 12, 13] * 7]


def backend(model, **kw):
    args = dict(page_size=4, num_pages=96, max_rows=8, max_seqs=16, max_prefill_tokens=128,
                min_graph_context=8)
    args.update(kw)
    return CudaBackend(model, **args)


def decode_logits(be: CudaBackend, decoder, ctx_lens: list[int], padded: int = 8) -> torch.Tensor:
    """Logits of one decode step over stale-but-fixed KV, from ``decoder``,
    its rows padded to ``padded``."""
    r, cap = be._runner, be.capacity
    pages = scattered_pages(ctx_lens, cap.page_size, cap.num_pages, seed=3)
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(), position=n - 1, pages=pages[i])
                 for i, n in enumerate(ctx_lens))
    staging = np.zeros(staging_size(cap), dtype=np.int64)
    b, p = padded, 16  # padded rows and pages past each row's own
    count = r.pack_decode(StepPlan(0, StepKind.DECODE, rows), staging, b, p)
    r.decode_meta[:count] = torch.from_numpy(staging[:count])
    r.last_token[:len(ctx_lens)] = torch.tensor([3, 17, 40, 99][:len(ctx_lens)])
    with torch.no_grad():
        return decoder(*r.decode_inputs(b, p))[:len(ctx_lens)]


@pytest.mark.parametrize("new_token,mlp_act", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_step_gives_transformers_logits(arch, new_token, mlp_act):
    """Rotary, the KV write and attention as one op, with Phi's MLP
    activation in it (the default) or not, or as three steps: transformers'
    logits every way."""
    model = tiny_model(arch, seed=7)
    be = backend(model, kernels=KernelConfig(new_token=new_token, mlp_act=mlp_act))
    decoder = be._runner.decoder
    assert isinstance(decoder, FusedDecoder) and be.decode_path == f"fused {arch}"
    assert decoder.rope_in_kernel == new_token
    assert decoder.dims.act == (1 if arch == "phi" and mlp_act else 0)  # tiny Phi: gelu_new
    torch.manual_seed(0)
    be.cache.data.normal_()  # KV the step reads; both decoders write the same new entries
    fused = decode_logits(be, be._runner.decoder, [1, 6, 17, 9])
    plain = decode_logits(be, TransformersDecoder(model), [1, 6, 17, 9])
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_and_transformers_steps_decode_the_same_tokens(arch):
    model = tiny_model(arch, seed=8)
    plain = generate(backend(model, fused_decode=False), PROMPTS, 12, page_seed=1)
    be = backend(model)
    assert be.decode_path == f"fused {arch}"
    assert generate(be, PROMPTS, 12, page_seed=1) == plain


@pytest.mark.parametrize("arch", ARCHS)
def test_fusing_stores_no_weight_twice_and_leaves_transformers_forward_alone(arch):
    model = tiny_model(arch, seed=9)
    ids = torch.tensor([[5, 9, 17, 33, 4, 8]])
    with torch.no_grad():
        before = model(ids).logits
    params = sum(p.numel() for p in model.parameters())
    decoder, why = make_decoder(model, KernelConfig())
    assert why is None
    attn = model.model.layers[0].self_attn
    fused = decoder.weights[0][2 if arch == "phi" else 1]  # qkv(+fc1)
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    if arch == "phi":  # the output projection and fc2 are column views of one weight
        mlp = model.model.layers[0].mlp
        assert attn.dense.weight.untyped_storage().data_ptr() == \
            mlp.fc2.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == params
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_compiled_step_is_one_graph_for_every_layer(arch):
    """Compiled, the fused step (rotary and attention as one op, for Phi
    the MLP activation too) traces into one graph that serves every layer:
    no graph break, no recompile (both would cost launches on the GPU,
    silently). The CPU compiler stands in for the GPU's."""
    from torch._dynamo.utils import counters

    model = tiny_model(arch, seed=7)
    be = backend(model)
    assert be._runner.decoder.dims.act == (arch == "phi") and be._runner.decoder.rope_in_kernel
    decoder = be._runner.decoder.compiled(True)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    be.cache.data.normal_()
    fused = decode_logits(be, decoder, [1, 6, 17, 9])
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    plain = decode_logits(be, TransformersDecoder(model), [1, 6, 17, 9])
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_phi_with_qk_layernorm_is_fused_and_matches():
    model = tiny_model("phi", seed=10, qk_layernorm=True)
    plain = generate(backend(model, fused_decode=False), PROMPTS, 8)
    assert generate(backend(model), PROMPTS, 8) == plain


def test_unsupported_models_fall_back_to_transformers_and_say_why():
    model = tiny_model("llama", seed=11, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                          "rope_theta": 10000.0})
    decoder, why = make_decoder(model, KernelConfig())
    assert isinstance(decoder, TransformersDecoder) and "dynamic" in why
    model = tiny_model("llama", seed=11).train()
    assert "training" in make_decoder(model, KernelConfig())[1]
    model = tiny_model("llama", seed=11)
    attn = model.model.layers[1].self_attn
    attn.k_proj.bias = torch.nn.Parameter(torch.zeros(attn.k_proj.out_features))
    decoder, why = make_decoder(model, KernelConfig())
    assert isinstance(decoder, TransformersDecoder) and "bias" in why
    decoder, why = make_decoder(tiny_model("llama"), KernelConfig(), fused=False)
    assert isinstance(decoder, TransformersDecoder) and why == "not asked for"
    be = backend(tiny_model("qwen2"), fused_decode=False)
    assert be.decode_path == "transformers"


# -- prefill as token rows (cuda_backend/token_prefill.py) --------------------

@pytest.fixture
def token_steps(monkeypatch):
    """Counts prefills that took the token-row path."""
    from bubblefree.cuda_backend.token_prefill import TokenPrefill
    calls = []
    forward = TokenPrefill.forward
    monkeypatch.setattr(TokenPrefill, "forward",
                        lambda self, t, r: calls.append((t, r)) or forward(self, t, r))
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_token_row_prefill_decodes_like_the_padded_prefill(arch, token_steps):
    model = tiny_model(arch, seed=12)
    prompts = PROMPTS + [[42], list(range(3, 40))]  # 66 tokens: bucket 128, 5 rows: bucket 8
    plain = generate(backend(model, token_prefill=0), prompts, 8, page_seed=2)
    assert token_steps == []
    be = backend(model, token_prefill=128)
    assert be.prefill_path.startswith("token rows")
    assert generate(be, prompts, 8, page_seed=2) == plain
    assert token_steps == [(128, 8)]


def test_token_row_prefill_honours_sliding_windows(token_steps):
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1,
                       num_hidden_layers=3, seed=13)
    prompts = [list(range(5, 30)), [9, 8, 7, 6, 5, 4, 3, 2, 1] * 2]
    plain = generate(backend(model, token_prefill=0), prompts, 8)
    assert generate(backend(model, token_prefill=64), prompts, 8) == plain
    assert len(token_steps) == 1


def test_token_row_prefill_continuing_a_prefix_matches(token_steps):
    """A prompt split over two prefills (the second starts past position 0)."""
    model = tiny_model("llama", seed=14)
    prompt = list(range(4, 30))
    outs = []
    for tokens in (0, 64):
        be = backend(model, token_prefill=tokens)
        pages = scattered_pages([len(prompt) + 2], 4, 96, seed=6)[0]
        got = []
        for step, (start, end) in enumerate([(0, 11), (11, len(prompt))]):
            row = StepRow(seq_id=0, row_slot=3, tokens=tuple(prompt[start:end]), position=start,
                          pages=pages)
            be.launch(step, StepPlan(step, StepKind.PREFILL, (row,)))
            be.finalize(step, SamplePlan(step, (None,)))
            got.append(be.wait(step).tokens[0])
            be.release(step)
        outs.append(got[-1])
    assert outs[0] == outs[1] and len(token_steps) == 2


def test_token_row_prefill_pads_only_into_the_scratch_page():
    model = tiny_model("phi", seed=15)
    be = backend(model, token_prefill=64)
    tp = be._runner.token_prefill
    pages = scattered_pages([9, 5], 4, 96, seed=7)
    rows = (StepRow(seq_id=0, row_slot=0, tokens=tuple(range(3, 12)), position=0, pages=pages[0]),
            StepRow(seq_id=1, row_slot=1, tokens=(5, 6, 7, 8, 9), position=0, pages=pages[1]))
    plan = StepPlan(0, StepKind.PREFILL, rows)
    assert tp.fits(plan)
    before = be.cache.data.clone()
    be.launch(0, plan)  # 14 tokens -> bucket 16 (2 padded), 2 rows -> bucket 2
    be.finalize(0, SamplePlan(0, (None, None)))
    be.wait(0)
    be.release(0)
    ps = be.capacity.page_size
    touched = {p for r in rows for p in r.pages[:-(-len(r.tokens) // ps)]}
    changed = {p for p in range(be.capacity.num_pages + 1)
               if not torch.equal(be.cache.data[:, :, p], before[:, :, p])}
    # Padded tokens (id 0, position 0) may write zeros: the scratch page may
    # look unchanged; no other page may change.
    assert touched <= changed <= touched | {be.cache.scratch_page}


def test_only_short_prefills_take_token_rows():
    be = backend(tiny_model("llama", seed=16), token_prefill=32)
    tp = be._runner.token_prefill
    short = StepPlan(0, StepKind.PREFILL, (StepRow(0, 0, tuple(range(20)), 0, tuple(range(5))),))
    long = StepPlan(0, StepKind.PREFILL, (StepRow(0, 0, tuple(range(40)), 0, tuple(range(10))),))
    assert tp.fits(short) and not tp.fits(long)
    tp.key_budget = 100  # 20 tokens at positions 0..19 read 210 keys
    assert not tp.fits(short)
    assert backend(tiny_model("llama"), fused_decode=False,
                   token_prefill=32).prefill_path == "transformers"
