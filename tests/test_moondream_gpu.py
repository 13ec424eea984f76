"""moondream2's backend on a GPU: pinned buffers and value graphs, answers
equal to the native model in float32 with graphs and compiled, graphs equal
to eager, pipelined equal to blocking in bfloat16, no host sync in an image
prefill, and I10 for decode steps with and without value rows; the encoder
and prefill graphs captured at warm-up and never during a request, their
replays equal to their functions run eagerly. Skipped, with the reason,
where there is no GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bubblefree.core.values import PromptValue, SamplePlan, SamplingParams, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.drive import scattered_pages
from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.prepared import prepare
from bubblefree.cuda_backend.moondream.weights import random_model
from tests.moondream_world import C, DETECT, MIXED, OPTIONS, POINT, S, picture, reference, request, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: streams, events, pinned memory and graphs")


def make(model, **kw):
    # Uncompiled unless a test asks (compiling costs seconds per backend).
    return MoondreamBackend(model, **{**OPTIONS, "compile_decode": False, **kw})


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=21, device="cuda")


def workload(be, sampling=SamplingParams()):
    images = [picture(300, 640, 1), picture(500, 500, 2), picture(900, 260, 3)]
    return [request(be.image_ref(im), [5 + i, 9], kinds, sampling)
            for i, (im, kinds) in enumerate(zip(images, (DETECT, MIXED, POINT)))]


def test_value_buffers_are_pinned_and_every_bucket_has_a_value_graph(model):
    be = make(model)
    for v in be._vslots:
        assert v.kinds_staging.is_pinned() and v.landing.is_pinned()
        assert v.hidden.device.type == "cuda"
    assert be._value_graphs.enabled and len(be._value_graphs) == 2 * 2 * len(be._rows)
    assert be.image_ref(picture(200, 300, 0)).source.crops.is_pinned()


def test_crops_made_on_the_device_equal_the_hosts_and_wait_for_no_step(model):
    """A caller's image is resized and cut on the backend's crop stream: the
    same pixels as the host's Pillow path, back in pinned memory, and the
    caller waits for its own work, not for what the compute stream runs."""
    be = make(model)  # on by default
    assert be._crop_stream is not None and make(model, crops_on_device=False)._crop_stream is None
    vision = be.config.vision
    for h, w in ((200, 300), (756, 756), (379, 1001), (378, 378)):
        image = picture(h, w, h + w)
        host = prepare(image, vision, pin=True)
        made = be.image_ref(image).source
        assert made.crops.is_pinned() and made.tiling == host.tiling
        assert torch.equal(made.crops, host.crops)
    busy = torch.cuda.Event()
    torch.cuda._sleep(1_000_000_000)  # about a second of a busy compute stream
    busy.record()
    be.image_ref(picture(756, 756, 5))
    assert not busy.query()  # the crops came back while the step was still running
    torch.cuda.synchronize()


@pytest.mark.parametrize("compiled", [False, True])
def test_answers_equal_the_native_model_in_float32(model, compiled):
    be = make(model, compile_decode=compiled)
    assert be._decode_graphs.enabled
    for (h, w), kinds in (((200, 300), DETECT), ((700, 900), MIXED), ((379, 1001), POINT)):
        image = picture(h, w, h)
        [got] = run(be, [request(be.image_ref(image), [7, 19, 3], kinds)])
        assert got == reference(model, image, [7, 19, 3], kinds)


@pytest.mark.parametrize("off", [{"use_graphs": False}, {"prefill_graphs": False}])
def test_graphs_equal_eager(model, off):
    sampling = SamplingParams(0.8, 0.9, 5)
    graphs, eager = make(model), make(model, **off)
    assert eager._prefill is None and eager._encoder is None
    assert run(graphs, workload(graphs, sampling)) == run(eager, workload(eager, sampling))


def test_prompt_values_in_the_prefill_graphs_equal_the_native_model(model):
    """Spatial references through the captured prefill (fresh image, kept
    image, text row) in float32 on the GPU, equal to the native model."""
    refs = (PromptValue(1, C, 0.25), PromptValue(2, C, 0.625), PromptValue(3, S, (0.5, 0.125)),
            PromptValue(4, C, 0.875))
    shifted = tuple(PromptValue(r.index + 1, r.kind, r.value) for r in refs)
    be = make(model)
    assert be._prefill.graphs.enabled
    image, other = picture(300, 500, 4), picture(400, 400, 6)
    encoded = be.encode_image(other)
    run(be, [request(be.image_ref(encoded), [5], POINT)])  # keeps its prefix KV
    prompt = [7, 90, 90, 91, 90]
    reqs = [request(be.image_ref(image), prompt, POINT, prompt_values=refs),
            request(be.image_ref(encoded), prompt, POINT, prompt_values=refs),
            request(None, [1, *prompt], DETECT, prompt_values=shifted)]
    assert run(be, reqs) == [reference(model, image, prompt, POINT, refs),
                             reference(model, other, prompt, POINT, refs),
                             reference(model, None, [1, *prompt], DETECT, shifted)]


def graph_count(be) -> int:
    sets = (be._decode_graphs, be._sample_graphs, be._value_graphs, be._encoder.graphs,
            be._prefill.graphs)
    return sum(len(g) for g in sets)


def test_encoder_and_prefill_graphs_are_captured_at_warm_up_and_only_then(model, monkeypatch):
    be = make(model)
    enc, pre = be._encoder, be._prefill
    assert enc.graphs.enabled and len(enc.graphs) == len(enc.buckets) == 16
    assert pre.graphs.enabled and len(pre.graphs) == len(pre.keys()) > 0
    assert enc.graphs.pool == pre.graphs.pool == be._decode_graphs.pool
    replayed = []
    for graphs in (enc.graphs, pre.graphs):
        def recorded(key, fn, graphs=graphs, run=graphs.run):
            replayed.append(key in graphs._graphs)
            return run(key, fn)
        monkeypatch.setattr(graphs, "run", recorded)
    before = graph_count(be)
    kept = be.encode_image(picture(640, 480, 8))
    requests = workload(be) + [request(be.image_ref(kept), [4], POINT),
                               request(None, [1, 30, 31], MIXED)]
    run(be, requests)
    run(be, [request(be.image_ref(kept), [2, 3], DETECT)])  # the kept image's KV reused
    assert graph_count(be) == before
    assert replayed and all(replayed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_image_prefills_replays_equal_their_eager_computation(dtype):
    """The encoder's replay against its function run eagerly on the same
    static crops; the prefill's against its function on the same static
    metadata (which rewrites the same KV)."""
    be = make(random_model(tiny_config(), seed=4, device="cuda", dtype=dtype))
    close = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    kept = be.encode_image(picture(500, 700, 3))
    run(be, [request(be.image_ref(kept), [3], POINT)])
    cap = be.capacity
    pages = scattered_pages([800] * 3, cap.page_size, cap.num_pages, seed=1)
    images = [picture(1100, 1300, 1), kept, picture(1300, 1100, 2)]
    crops = sum(be.image_ref(im).source.n_crops for im in images[::2])
    assert crops > be._encoder.chunk  # two chunks of crops
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=tuple(range(5, 5 + 2 * i + 1)),
                         position=0, pages=pages[i], image=be.image_ref(im))
                 for i, im in enumerate(images))
    keys, features = [], []  # features: (crop count, the replay's output) per chunk
    enc_run, pre_run = be._encoder.graphs.run, be._prefill.graphs.run
    be._encoder.graphs.run = lambda key, fn: features.append((key, enc_run(key, fn).clone())) \
        or features[-1][1]
    be._prefill.graphs.run = lambda key, fn: keys.append(key) or pre_run(key, fn)
    try:
        be.launch(0, StepPlan(0, StepKind.IMAGE_PREFILL, rows))
    finally:
        del be._encoder.graphs.run, be._prefill.graphs.run
    torch.cuda.synchronize()
    [key] = keys
    assert key in be._prefill.graphs._graphs and key[1] == 4  # three rows pad to four
    logits, hidden = be._slots[0].logits[:3].clone(), be._vslots[0].hidden[:3].clone()
    kv = be.cache.data.clone()
    with torch.no_grad():
        eager_logits, eager_hidden = be._prefill.forward(*key)
        torch.testing.assert_close(logits, eager_logits[:3].float(), **close)
        torch.testing.assert_close(hidden, eager_hidden[:3], **close)
        torch.testing.assert_close(be.cache.data, kv, **close)
        n, got = features[-1]  # the last chunk's crops are still in the static buffer
        torch.testing.assert_close(got, be._encoder.encode(n), **close)
    assert sum(k for k, _ in features) == crops
    be.finalize(0, SamplePlan(0, (None,) * 3))
    be.wait(0)
    be.release(0)


def test_pipelined_equals_blocking_in_bfloat16():
    be = make(random_model(tiny_config(), seed=4, device="cuda", dtype=torch.bfloat16))
    for sampling in (SamplingParams(), SamplingParams(0.8, 0.9, 5)):
        assert run(be, workload(be, sampling)) == run(be, workload(be, sampling), pipelined=False)


def test_image_prefill_and_steady_decode_make_no_sync_and_decode_no_allocation(model):
    """An image prefill may allocate (its shapes vary) but never syncs; a
    steady-state decode step, with or without value rows, neither (I10).
    ``wait`` syncs on its copy's event by design: outside the debug mode."""
    be = make(model)
    cap = be.capacity
    n = 3
    pages = scattered_pages([800] * n, cap.page_size, cap.num_pages)
    refs = [be.image_ref(picture(400 + 100 * i, 500, i)) for i in range(n)]
    sampling = [SamplingParams(temperature=0.7 * i, seed=i) for i in range(n)]
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(5, 6), position=0, pages=pages[i],
                         sampling=sampling[i], image=refs[i]) for i in range(n))
    start = be.prefix_len + 2
    torch.cuda.synchronize()
    with strict():
        be.launch(0, StepPlan(0, StepKind.IMAGE_PREFILL, rows))
        be.finalize(0, SamplePlan(0, (None,) * n, (C, None, S)))
    schedule = [(C, C, S), (None,) * n, (S, C, None), (C, None, C)]
    last_step = 14  # asks (S, C, None): the last output holds values
    for step in range(1, last_step + 1):
        slot, steady = step % 2, step > 4
        rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(), position=start + step - 1,
                             pages=pages[i], sampling=sampling[i]) for i in range(n))
        kinds = schedule[step % len(schedule)]
        sample = SamplePlan(step, (None,) * n, () if kinds == (None,) * n else kinds)
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
        with strict(steady):
            be.launch(slot, StepPlan(step, StepKind.DECODE, rows))
        assert len(be.wait(1 - slot).tokens) == n  # commit t while t+1 runs
        be.release(1 - slot)
        with strict(steady):
            be.finalize(slot, sample)
        torch.cuda.synchronize()
        assert not steady or torch.cuda.memory_stats()["allocation.all.allocated"] == allocs
    last = be.wait(last_step % 2)
    be.release(last_step % 2)
    kinds = schedule[last_step % len(schedule)]
    assert [v is None for v in last.values] == [k is None for k in kinds]


@contextlib.contextmanager
def strict(on: bool = True):
    """Any host sync inside raises (when ``on``)."""
    torch.cuda.set_sync_debug_mode("error" if on else "default")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
