"""The CUDA backend as the core sees it: the Backend protocol, failures as
StepFailed, and the whole Engine on real models — pipelined equals blocking
(I8, greedy and seeded sampling) equals transformers' ``generate``. The slot
call order and plan checks are the contract's (test_backend_contract.py)."""

from __future__ import annotations

import pytest
import torch

from bubblefree.core.protocol import Backend
from bubblefree.core.engine import Engine
from bubblefree.core.values import Request, SamplePlan, SamplingParams, Status, StepFailed, StepKind, StepPlan
from bubblefree.core.values import StepRow
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.slots import SlotState
from bubblefree.cuda_backend.tiny import tiny_model

PROMPTS = [[5, 9, 17, 33, 4], [7, 8], [100, 3, 3, 3, 3, 3, 3, 3, 3, 2], [11, 12, 13] * 7, [42],
           [60, 61]]


def make(model, **kw):
    args = dict(page_size=4, num_pages=128, max_rows=3, max_seqs=8, max_prefill_tokens=48,
                min_graph_context=8)
    args.update(kw)
    return CudaBackend(model, **args)


def prefill(seq=0, slot=0):
    return StepRow(seq_id=seq, row_slot=slot, tokens=(1, 2, 3), position=0, pages=(0, 1))


def test_satisfies_the_backend_protocol():
    be = make(tiny_model("llama"))
    assert isinstance(be, Backend)
    cap = be.capacity
    assert (cap.num_pages, cap.page_size, cap.max_rows, cap.max_seqs) == (128, 4, 3, 8)
    assert cap.max_context == 256 and be.vocab_size == 128
    # Its launch computes the step where the model is: asynchronous only on CUDA.
    assert cap.asynchronous is (be.device.type == "cuda")


def test_auto_takes_blocking_s_order_on_the_cpu():
    """Torch on a CPU computes a step inside ``launch``: launching ahead hides
    nothing there (bench.speed --tiny: blocking 28-32% ahead of pipelined on point,
    docs/runs/cpu-modes-2026-12-02.txt), so auto commits at every tick."""
    be = make(tiny_model("llama", device="cpu"))
    engine = Engine(be, pipelined="auto")
    handles = [engine.submit(Request(prompt=tuple(p), max_tokens=6)) for p in PROMPTS[:3]]
    engine.run_until_idle(max_ticks=200)
    assert all(h.result.status is Status.COMPLETED for h in handles)
    assert engine.ahead_ticks == 0 and engine.behind_ticks > 0


def test_a_failing_forward_is_step_failed_and_the_slot_stays_free(monkeypatch):
    be = make(tiny_model("phi"))

    def boom(*args):
        raise RuntimeError("device on fire")
    monkeypatch.setattr(be._runner, "prefill_forward", boom)
    with pytest.raises(StepFailed, match="device on fire"):
        be.launch(1, StepPlan(0, StepKind.PREFILL, (prefill(),)))
    assert be._slots[1].state is SlotState.FREE
    monkeypatch.undo()
    be.launch(1, StepPlan(1, StepKind.PREFILL, (prefill(),)))
    be.finalize(1, SamplePlan(1, (None,)))
    assert len(be.wait(1).tokens) == 1
    be.release(1)


def reference(model, prompts, new, eos):
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=0)
            out.append(tuple(ids[0, len(p):].tolist()))
    return out


def run_engine(be, requests, pipelined):
    engine = Engine(be, pipelined=pipelined)
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle(max_ticks=10_000)
    engine.check_integrity()
    return [h.result for h in handles]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_greedy_matches_generate_pipelined_and_blocking(arch):
    model = tiny_model(arch, seed=7)
    first = reference(model, PROMPTS[:1], 3, None)[0]
    eos = first[2]  # a token the first prompt really emits, so a request stops early
    want = reference(model, PROMPTS, 12, eos)
    be = make(model)
    requests = [Request(prompt=p, max_tokens=12, stop_ids={eos}) for p in PROMPTS]
    for pipelined in (True, False):
        results = run_engine(be, requests, pipelined)
        assert [r.tokens for r in results] == want
        assert all(r.status is Status.COMPLETED for r in results)
        assert results[0].finish_reason == "stop"
        assert len(results[0].tokens) == first.index(eos) + 1


def test_engine_sampling_pipelined_equals_blocking():
    """I8 with sampling on: seeded per request and position."""
    be = make(tiny_model("phi", seed=8))
    requests = [Request(prompt=p, max_tokens=10,
                        sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i))
                for i, p in enumerate(PROMPTS)]
    piped = [r.tokens for r in run_engine(be, requests, True)]
    blocking = [r.tokens for r in run_engine(be, requests, False)]
    assert piped == blocking
    assert len(set(piped)) == len(piped)


class OnlyFrom:
    """A decode state that allows one registered set for three tokens (I9)."""

    def __init__(self, mask_id):
        self.mask_id_, self.n = mask_id, 0

    def mask_id(self):
        return self.mask_id_

    def advance(self, token, value):
        self.n += 1
        return self.n == 3


def test_engine_constrained_rows_stay_in_their_mask():
    be = make(tiny_model("llama", seed=9))
    engine = Engine(be, pipelined=True)
    allowed = frozenset({17, 23, 99})
    mask = engine.register_mask(allowed)
    handles = [engine.submit(Request(prompt=p, max_tokens=8, decode_state=lambda: OnlyFrom(mask),
                                     sampling=SamplingParams(temperature=1.0, seed=i)))
               for i, p in enumerate(PROMPTS[:4])]
    engine.run_until_idle(max_ticks=10_000)
    for h in handles:
        assert len(h.result.tokens) == 3 and set(h.result.tokens) <= allowed
