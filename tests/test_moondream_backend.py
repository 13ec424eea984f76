"""moondream2 through the CUDA backend (on the CPU here), driven by the core
Engine: image prefill and decode against the native whole-sequence model
(``Moondream``: vision, ``TextDecoder`` under the prefix mask, region
functions), values fed back as the next input like the reference's point
and detect loops, pipelined equal to blocking (I8), an ``EncodedImage``
encoded once and reused, and images batched in one step equal to one at a
time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bubblefree.core.engine import Engine
from bubblefree.core.values import (Request, SamplePlan, SamplingParams, Status, StepKind,
                                    StepPlan, StepRow, ValueKind)
from bubblefree.cuda_backend.errors import PlanRejected
from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.build import build
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.image_crops import plan_crops
from bubblefree.cuda_backend.moondream.region import coordinate_value, size_value
from bubblefree.cuda_backend.moondream.weights import random_model

C, S = ValueKind.COORD, ValueKind.SIZE
OPTIONS = dict(page_size=16, num_pages=400, max_rows=4, max_seqs=8, max_prefill_tokens=3200,
               min_graph_context=16)
# A point-like run (token and x from the prefill's hidden, then y), a
# detect-like one (x, y, size, then a token with the next x), and plain text
# between values, so flags are set and cleared in every order.
POINT = (C, C, C, C)
DETECT = (C, C, S, C, C, S)
MIXED = (None, C, None, S, S, None, C)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=21)


@pytest.fixture(scope="module")
def backend(model):
    return MoondreamBackend(model, **OPTIONS)


def picture(height: int, width: int, seed: int) -> Image.Image:
    # Smooth gradients plus noise: crops of one image differ, images differ.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1),
                     (x + y) * 127 // max(height + width, 1)], axis=-1)
    noise = rng.integers(0, 60, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def reference(model, image, prompt, kinds):
    """The native model over the whole sequence at every step (no cache):
    each step's token is the argmax of the last position's logits; where a
    step asks a value it is decoded from the same hidden state, greedily,
    and its encoding is the next input, else the token's embedding."""
    region, text = model.region, model.text
    tokens, values = [], []
    with torch.no_grad():
        x = torch.cat([model.image_prefix(image), text.embed(torch.tensor(prompt))])  # [L, D]
        for kind in kinds:
            h = text(x[None])[0, -1]  # before the final norm
            tokens.append(int(text.logits(h).argmax()))
            if kind is C:
                value = coordinate_value(region.decode_coordinate(h).argmax(), 1024)
                nxt = region.encode_coordinate(value.reshape(1))
                values.append(float(value))
            elif kind is S:
                size = size_value(region.decode_size(h).argmax(-1), 1024)  # [2]
                nxt = region.encode_size(size)
                values.append((float(size[0]), float(size[1])))
            else:
                nxt = text.embed(torch.tensor(tokens[-1]))
                values.append(None)
            x = torch.cat([x, nxt[None]])
    return [tokens, values]


class Script:
    """A decode state asking the values of ``kinds``, one per step, and
    keeping what it was given."""

    def __init__(self, kinds):
        self.kinds, self.values = kinds, []

    def mask_id(self):
        return None

    def value_kind(self):
        return self.kinds[len(self.values)]

    def advance(self, token, value):
        self.values.append(value)
        return len(self.values) == len(self.kinds)


def request(ref, prompt, kinds, sampling=SamplingParams()):
    return Request(prompt=tuple(prompt), max_tokens=len(kinds) + 1, image=ref,
                   decode_state=lambda: Script(kinds), sampling=sampling,
                   finisher=lambda tokens, state: tuple(state.values))


def run(backend, requests, pipelined=True):
    engine = Engine(backend, pipelined=pipelined)
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle(max_ticks=10_000)
    engine.check_integrity()
    results = [h.result for h in handles]
    assert all(r.status is Status.COMPLETED for r in results), results
    return [[list(r.tokens), list(r.output)] for r in results]


def recording(backend, monkeypatch):
    """Record every plan the backend launches."""
    plans, launch = [], backend.launch

    def record(slot, plan):
        plans.append(plan)
        return launch(slot, plan)
    monkeypatch.setattr(backend, "launch", record)
    return plans


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


def test_images_batched_in_one_step_equal_one_at_a_time(backend, monkeypatch):
    images = [picture(260, 300, 5), picture(800, 600, 6), picture(400, 1200, 7)]
    reqs = [request(backend.image_ref(im), [11, 12 + i], kinds)
            for i, (im, kinds) in enumerate(zip(images, (POINT, DETECT, MIXED)))]
    alone = [run(backend, [r])[0] for r in reqs]
    plans = recording(backend, monkeypatch)
    assert run(backend, reqs) == alone
    first = plans[0]
    assert first.kind is StepKind.IMAGE_PREFILL and len(first.rows) == 3


def test_an_encoded_image_is_encoded_once_and_answers_like_a_fresh_one(backend, monkeypatch):
    image = picture(640, 480, 8)
    fresh = run(backend, [request(backend.image_ref(image), [2, 3], DETECT),
                          request(backend.image_ref(image), [4], POINT)])
    encoded = backend.encode_image(image)
    assert not encoded.encoded
    calls = []
    embed = backend.vision.embed
    monkeypatch.setattr(backend.vision, "embed", lambda *a: calls.append(a) or embed(*a))
    first = run(backend, [request(backend.image_ref(encoded), [2, 3], DETECT)])
    assert encoded.encoded and encoded.prepared is None  # crops dropped once it completed
    second = run(backend, [request(backend.image_ref(encoded), [4], POINT)])
    assert first + second == fresh
    assert len(calls) == 1
    # Two rows of one step sharing an image that is not encoded yet: once.
    again = backend.encode_image(image)
    both = run(backend, [request(backend.image_ref(again), [2, 3], DETECT),
                         request(backend.image_ref(again), [4], POINT)])
    assert both == fresh and len(calls) == 2


def test_a_text_prefill_is_causal_and_values_work_without_an_image(model, backend):
    # No image: the native model over BOS and the prompt, plain causal.
    prompt = [1, 30, 31, 32]
    [got] = run(backend, [Request(prompt=tuple(prompt), max_tokens=4,
                                  decode_state=lambda: Script((None, C, S, None)),
                                  finisher=lambda tokens, state: tuple(state.values))])
    text, region = model.text, model.region
    with torch.no_grad():
        x = text.embed(torch.tensor(prompt))
        h = text(x[None], prefix=0)[0, -1]
        first = int(text.logits(h).argmax())
    assert got[0][0] == first and got[1][0] is None


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
    for ref in (attrs_evolve(backend.image_ref(picture(200, 200, 10)), source="pixels"),
                attrs_evolve(backend.image_ref(picture(200, 200, 10)), length=729),
                attrs_evolve(backend.image_ref(picture(200, 200, 10)), source=foreign)):
        rows = (StepRow(seq_id=0, row_slot=0, tokens=(3,), position=0, pages=tuple(range(46)),
                        image=ref),)
        with pytest.raises(PlanRejected):
            backend.launch(0, StepPlan(0, StepKind.IMAGE_PREFILL, rows))
    with pytest.raises(Exception, match="another backend"):
        backend.image_ref(foreign)


def attrs_evolve(ref, **changes):
    import attrs
    return attrs.evolve(ref, **changes)
