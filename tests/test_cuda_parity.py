"""Greedy parity: the backend (paged KV, packed prefill, our attention)
decodes the same tokens as transformers' own ``generate`` on tiny random
Llama, Phi and Qwen2 decoders, on the CPU."""

from __future__ import annotations

import pytest
import torch

from bubblefree.core.values import SamplePlan, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.drive import generate, scattered_pages
from bubblefree.cuda_backend.tiny import tiny_model

PROMPTS = [[5, 9, 17, 33, 4], [7, 8], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2],
           [11, 12, 13] * 11, [42]]
NEW = 10


def reference(model, prompts, new):
    """transformers' greedy decode, one prompt at a time (no padding)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def backend_for(model, **kw):
    args = dict(page_size=4, num_pages=96, max_rows=8, max_seqs=16, max_prefill_tokens=128,
                min_graph_context=8)
    args.update(kw)
    return CudaBackend(model, **args)


@pytest.mark.parametrize("arch", ["llama", "phi", "qwen2"])
def test_greedy_matches_transformers_generate(arch):
    model = tiny_model(arch)
    want = reference(model, PROMPTS, NEW)
    be = backend_for(model)
    # scattered pages, row slots out of order, rows of mixed lengths
    assert generate(be, PROMPTS, NEW, row_slots=[9, 3, 15, 0, 7], page_seed=1) == want


def test_qwen2_sliding_window_matches():
    """Layers with a sliding window attend only to the last ``window`` keys."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1,
                       num_hidden_layers=3)
    assert "sliding_attention" in model.config.layer_types
    prompts = [PROMPTS[2], PROMPTS[3]]
    want = reference(model, prompts, NEW)
    assert generate(backend_for(model), prompts, NEW) == want


def test_prefill_continuing_a_prefix_matches():
    """A prefill row may start past position 0 (its prefix's KV already in
    its pages): splitting a prompt over two prefills changes nothing."""
    model = tiny_model("llama", seed=3)
    prompt = PROMPTS[3]
    want = reference(model, [prompt], 4)[0]
    be = backend_for(model)
    pages = scattered_pages([len(prompt) + 4], 4, 96, seed=5)[0]
    cut = 13
    first = StepRow(seq_id=0, row_slot=2, tokens=tuple(prompt[:cut]), position=0, pages=pages)
    be.launch(0, StepPlan(0, StepKind.PREFILL, (first,)))
    be.finalize(0, SamplePlan(0, (None,)))
    be.wait(0)
    be.release(0)
    rest = StepRow(seq_id=0, row_slot=2, tokens=tuple(prompt[cut:]), position=cut, pages=pages)
    be.launch(1, StepPlan(1, StepKind.PREFILL, (rest,)))
    be.finalize(1, SamplePlan(1, (None,)))
    got = [be.wait(1).tokens[0]]
    be.release(1)
    for step in range(2, 5):
        row = StepRow(seq_id=0, row_slot=2, tokens=(), position=len(prompt) + step - 2, pages=pages)
        be.launch(step % 2, StepPlan(step, StepKind.DECODE, (row,)))
        be.finalize(step % 2, SamplePlan(step, (None,)))
        got.append(be.wait(step % 2).tokens[0])
        be.release(step % 2)
    assert got == want


def test_padded_rows_write_nowhere():
    """Decode steps run at bucket sizes (3 rows pad to 4): the padded row
    must not disturb any real sequence, so results equal a run alone."""
    model = tiny_model("phi", seed=1)
    alone = [generate(backend_for(model), [p], 6)[0] for p in PROMPTS[:3]]
    together = generate(backend_for(model), PROMPTS[:3], 6)
    assert together == alone


def test_batch_of_one_token_prompts():
    model = tiny_model("llama", seed=2)
    prompts = [[i] for i in range(1, 9)]
    want = reference(model, prompts, 5)
    assert generate(backend_for(model), prompts, 5) == want
