"""Transformers VLMs on a GPU: every architecture's greedy answers about
images, in float32 with decode graphs, equal transformers' ``generate`` on
the same checkpoint; pipelined equals blocking in bfloat16; the pixels land
in pinned memory. Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from bubblefree import Engine
from bubblefree.cuda_backend.vlm.tower_graphs import FIXED
from tests import vlm_world
from tests.serving_world import WAIT, wait_idle
from tests.vlm_world import IMAGES, QUESTIONS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: streams, pinned memory and graphs")

OPTIONS = dict(device="cuda", page_size=16, num_pages=64, max_rows=4, max_seqs=8, compile_decode=False)
ARCHS = [("llava", "llama"), ("llava", "qwen2"), ("llava_next", "llama"), ("idefics3", "llama"),
         ("smolvlm", "llama"), ("paligemma", "gemma"), ("qwen2_vl", "qwen2"), ("qwen2_5_vl", "qwen2")]


@pytest.mark.parametrize("arch, text", ARCHS, ids=lambda p: p)
def test_answers_on_the_gpu_equal_generate(tmp_path, arch, text):
    path = vlm_world.checkpoint(tmp_path, seed=3, text_type=text, arch=arch)
    model, processor = vlm_world.reference(path, arch)
    cases = [(image, q) for image in IMAGES for q in QUESTIONS[:2]]
    expected = [vlm_world.generate(model, processor, image, q, 8) for image, q in cases]
    engine = Engine.from_pretrained(str(path), dtype=torch.float32, **OPTIONS)
    try:
        assert engine.backend.device.type == "cuda"
        if arch in FIXED:  # its tower replays graphs, captured at build
            assert engine.backend._tower.graphs.enabled and len(engine.backend._tower.graphs) == 4
        ref = engine.images.ref(IMAGES[0])
        assert all(t.is_pinned() for t in ref.source.tensors.values())
        for pipelined in (False, True):
            engine.pipelined = pipelined
            got = [h.result(WAIT).tokens for h in engine.submit_many(
                [("query", dict(image=image, question=q, max_tokens=8)) for image, q in cases])]
            assert [list(t) for t in got] == expected, pipelined
        wait_idle(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("arch, text", ARCHS, ids=lambda p: p)
def test_pipelined_equals_blocking_in_bfloat16(tmp_path, arch, text):
    path = vlm_world.checkpoint(tmp_path, seed=4, text_type=text, arch=arch)
    engine = Engine.from_pretrained(str(path), dtype=torch.bfloat16, **OPTIONS)
    try:
        calls = [("query", dict(image=image, question=q, max_tokens=12)) for image in IMAGES for q in QUESTIONS]
        runs = []
        for pipelined in (False, True, "auto"):
            engine.pipelined = pipelined
            runs.append([h.result(WAIT).tokens for h in engine.submit_many(calls)])
        assert runs[0] == runs[1] == runs[2]
        wait_idle(engine)
    finally:
        engine.close()
