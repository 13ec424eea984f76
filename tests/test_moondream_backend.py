"""moondream2 through the CUDA backend (on the CPU here), driven by the core
Engine: image prefill and decode against the native whole-sequence model
(``Moondream``: vision, ``TextDecoder`` under the prefix mask, region
functions), values fed back as the next input like the reference's point
and detect loops, pipelined equal to blocking (I8), an ``EncodedImage``
encoded once and reused, and images batched in one step equal to one at a
time."""

from __future__ import annotations

import attrs
import pytest
import torch

from bubblefree.core.values import PromptValue, SamplePlan, SamplingParams, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.errors import PlanRejected
from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.build import build
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.image_crops import plan_crops
from bubblefree.cuda_backend.moondream.weights import random_model
from tests.moondream_world import (C, DETECT, MIXED, OPTIONS, POINT, S, picture,
                                   recording, reference, request, run)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=21)


@pytest.fixture(scope="module")
def backend(model):
    return MoondreamBackend(model, **OPTIONS)


SIZES = [(200, 300), (379, 1001), (700, 900), (1234, 401)]


@pytest.mark.parametrize("height,width", SIZES)
def test_image_prefill_and_values_equal_the_native_model(model, backend, height, width):
    image = picture(height, width, seed=height)
    for kinds in (POINT, DETECT, MIXED):
        prompt = [7, 19, 3, 44][:2 + len(kinds) % 3]
        [got] = run(backend, [request(backend.image_ref(image), prompt, kinds)])
        assert got == reference(model, image, prompt, kinds), kinds


def test_the_sizes_cover_one_crop_and_several():
    counts = {plan_crops(h, w, tiny_config().vision).n_crops for h, w in SIZES}
    assert 2 in counts and max(counts) >= 7


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(0.8, 0.9, 5)])
def test_pipelined_equals_blocking(backend, sampling):
    images = [picture(300, 640, 1), picture(500, 500, 2), picture(900, 260, 3)]
    reqs = [request(backend.image_ref(im), [5 + i, 9], kinds, sampling)
            for i, (im, kinds) in enumerate(zip(images, (DETECT, MIXED, POINT)))]
    assert run(backend, reqs, pipelined=True) == run(backend, reqs, pipelined=False)


def test_sampled_values_are_seeded_per_request(backend):
    image = picture(320, 480, 4)

    def once(seed):
        sampling = SamplingParams(1.5, 1.0, seed)
        return run(backend, [request(backend.image_ref(image), [3, 4], DETECT, sampling)])
    assert once(1) == once(1)
    assert once(1) != once(2)  # 6 steps of tokens and bins: a collision is negligible


def test_top_k_of_one_draws_the_greedy_tokens_and_values_at_any_temperature(backend):
    """The cuts reach the region head's draws too: with one token (bin)
    left, a drawn request is the greedy one, whatever its seed."""
    image = picture(320, 480, 4)

    def once(sampling):
        return run(backend, [request(backend.image_ref(image), [3, 4], DETECT, sampling)])
    greedy = once(SamplingParams())
    assert once(SamplingParams(1.5, 1.0, 1, top_k=1)) == once(SamplingParams(1.5, 1.0, 2, top_k=1)) == greedy
    assert once(SamplingParams(1.5, 1.0, 3, min_p=1.0)) == greedy
    assert once(SamplingParams(1.5, 1.0, 1)) != greedy  # without the cut, the draw is not greedy's


def test_images_batched_in_one_step_equal_one_at_a_time(backend, monkeypatch):
    images = [picture(260, 300, 5), picture(800, 600, 6), picture(400, 1200, 7)]
    reqs = [request(backend.image_ref(im), [11, 12 + i], kinds)
            for i, (im, kinds) in enumerate(zip(images, (POINT, DETECT, MIXED)))]
    alone = [run(backend, [r])[0] for r in reqs]
    plans = recording(backend, monkeypatch)
    assert run(backend, reqs) == alone
    first = plans[0]
    assert first.kind is StepKind.IMAGE_PREFILL and len(first.rows) == 3


@pytest.fixture(scope="module")
def eager(model):
    return MoondreamBackend(model, **OPTIONS, prefill_graphs=False)


@pytest.mark.parametrize("path", ["backend", "eager"])
def test_an_encoded_image_is_encoded_once_and_answers_like_a_fresh_one(path, monkeypatch,
                                                                      backend, eager):
    """On the bucketed path (the graphs' code, eager here) and the eager one."""
    backend = {"backend": backend, "eager": eager}[path]
    image, other = picture(640, 480, 8), picture(300, 900, 12)
    fresh = run(backend, [request(backend.image_ref(image), [2, 3], DETECT),
                          request(backend.image_ref(image), [4], POINT),
                          request(backend.image_ref(other), [5, 6], MIXED)])
    encoded = backend.encode_image(image)
    assert not encoded.encoded
    calls, inputs = [], prefill_tokens(backend, monkeypatch)
    project = backend.vision.project_images  # once per encoder call, on either path
    monkeypatch.setattr(backend.vision, "project_images", lambda *a: calls.append(a) or project(*a))
    plans = recording(backend, monkeypatch)
    first = run(backend, [request(backend.image_ref(encoded), [2, 3], DETECT)])
    # Its prefix KV kept (what its row wrote at positions 0..729), its crops
    # dropped once the step completed.
    assert encoded.kv is not None and encoded.features is None and encoded.prepared is None
    assert torch.equal(encoded.kv, prefix_kv(backend, plans[0].rows[0]))
    # Reused beside a fresh image in one step: the kept row prefills its prompt
    # only, over the KV copied into its pages (nothing left in them before).
    backend.cache.data.zero_()
    plans.clear()
    second = run(backend, [request(backend.image_ref(encoded), [4], POINT),
                           request(backend.image_ref(other), [5, 6], MIXED)])
    assert torch.equal(prefix_kv(backend, plans[0].rows[0]), encoded.kv)
    assert first + second == fresh
    assert len(calls) == 2 and inputs == [730 + 2, 1 + 730 + 2]
    # Two rows of one step sharing an image that is not encoded yet: once.
    again = backend.encode_image(image)
    both = run(backend, [request(backend.image_ref(again), [2, 3], DETECT),
                         request(backend.image_ref(again), [4], POINT)])
    assert both == fresh[:2] and len(calls) == 3 and inputs[2] == 2 * 730 + 3


def test_a_text_prefill_is_causal_and_values_work_without_an_image(model, backend):
    kinds = (None, C, S, None, C)
    [got] = run(backend, [request(None, [1, 30, 31, 32], kinds)])
    assert got == reference(model, None, [1, 30, 31, 32], kinds)


def test_values_are_none_when_no_row_asks(backend):
    ref = backend.image_ref(picture(200, 200, 9))
    rows = (StepRow(seq_id=0, row_slot=0, tokens=(3,), position=0, pages=tuple(range(46)),
                    image=ref),)
    backend.launch(0, StepPlan(0, StepKind.IMAGE_PREFILL, rows))
    backend.finalize(0, SamplePlan(0, (None,)))
    out = backend.wait(0)
    backend.release(0)
    assert out.values is None and len(out.tokens) == 1


def test_image_sources_the_backend_did_not_make_are_refused_before_anything_runs(backend):
    other, _ = build(tiny_config(), seed=3, **OPTIONS)
    foreign = other.encode_image(picture(200, 200, 10))
    for ref in (attrs.evolve(backend.image_ref(picture(200, 200, 10)), source="pixels"),
                attrs.evolve(backend.image_ref(picture(200, 200, 10)), length=729),
                attrs.evolve(backend.image_ref(picture(200, 200, 10)), source=foreign)):
        rows = (StepRow(seq_id=0, row_slot=0, tokens=(3,), position=0, pages=tuple(range(46)),
                        image=ref),)
        with pytest.raises(PlanRejected):
            backend.launch(0, StepPlan(0, StepKind.IMAGE_PREFILL, rows))
    with pytest.raises(Exception, match="another backend"):
        backend.image_ref(foreign)


def prefill_tokens(backend, monkeypatch) -> list[int]:
    """Record the tokens each prefill runs (before any padding), on
    whichever path the backend takes."""
    tokens = []
    if backend._prefill is not None:
        launch = backend._prefill.launch

        def counted(slot, key, pages, inputs, *a):
            tokens.append(sum(len(x) for x in inputs))
            return launch(slot, key, pages, inputs, *a)
        monkeypatch.setattr(backend._prefill, "launch", counted)
    else:
        prefill = backend._runner.prefill
        monkeypatch.setattr(backend._runner, "prefill",
                            lambda meta, shape, *a, **kw: tokens.append(shape[0]) or prefill(meta, shape, *a, **kw))
    return tokens


def prefix_kv(backend, row) -> torch.Tensor:
    """The KV a row's pages hold at its image prefix's positions."""
    ps = backend.capacity.page_size
    slots = torch.tensor([row.pages[p // ps] * ps + p % ps for p in range(backend.prefix_len)])
    return backend.cache.gather(slots)


# The last prompt position holds a value too: its hidden state, which the
# first value is decoded from, then carries the value's input directly.
REFS = (PromptValue(1, C, 0.25), PromptValue(2, C, 0.625), PromptValue(3, S, (0.5, 0.125)),
        PromptValue(4, C, 0.875))


@pytest.mark.parametrize("graphs", [True, False], ids=["bucketed", "eager"])
def test_prompt_values_are_the_region_encoders_inputs_at_their_positions(model, graphs):
    """Spatial references: fresh image, encoded image and text rows in one
    engine, on the bucketed (graph) path and the eager one, pipelined and
    blocking, each equal to the native model with those positions' inputs
    replaced, and not to the same prompt without them."""
    backend = MoondreamBackend(model, **OPTIONS, prefill_graphs=graphs)
    image, other = picture(300, 500, 4), picture(400, 400, 6)
    encoded = backend.encode_image(other)
    prompt = [7, 90, 90, 91, 90]
    shifted = tuple(attrs.evolve(r, index=r.index + 1) for r in REFS)  # after BOS
    rows = [(image, prompt, POINT, REFS), (other, prompt, POINT, REFS), (None, [1, *prompt], DETECT, shifted)]
    want = [reference(model, im, p, kinds, refs) for im, p, kinds, refs in rows]
    assert all(w != reference(model, im, p, kinds) for w, (im, p, kinds, _) in zip(want, rows))
    for pipelined in (True, False):
        reqs = [request(None if im is None else backend.image_ref(im if im is image else encoded), p, kinds,
                        prompt_values=refs) for im, p, kinds, refs in rows]
        assert run(backend, reqs, pipelined) == want
