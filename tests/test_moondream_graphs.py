"""The image prefill's graph code (``prefill_graphs``, ``encoder_graphs``)
run eagerly on the CPU, against the unpadded eager path
(``prefill_graphs=False``): padded to token and row buckets, a step gives
the same logits, hidden states, tokens and KV contents, for odd token
counts, several rows, fresh and kept (``EncodedImage``) images and text
rows; padding writes no page outside the step's own positions but the
scratch page (I6); the encoder's chunks of crops equal one call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bubblefree.core.values import SamplePlan, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.drive import scattered_pages
from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.vision import normalize
from bubblefree.cuda_backend.moondream.weights import random_model
from tests.moondream_world import OPTIONS, picture

CLOSE = dict(rtol=1e-4, atol=1e-5)  # float32: a padded GEMM may sum in another order


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=13)


@pytest.fixture(scope="module")
def pair(model):
    """The bucketed path and the unpadded eager one, on one model."""
    return MoondreamBackend(model, **OPTIONS), MoondreamBackend(model, **OPTIONS,
                                                                 prefill_graphs=False)


def step(backend, plan):
    """Launch ``plan`` into slot 0 and finish it: its rows' logits, hidden
    states and tokens."""
    n = len(plan.rows)
    backend.launch(0, plan)
    logits = backend._slots[0].logits[:n].clone()
    hidden = backend._vslots[0].hidden[:n].clone()
    backend.finalize(0, SamplePlan(plan.step_id, (None,) * n))
    tokens = backend.wait(0).tokens
    backend.release(0)
    return logits, hidden, tokens


def rows_of(backend, specs, kind):
    """``specs``: (image or None, prompt) per row; images become this
    backend's refs; pages drawn scattered."""
    lengths = [len(p) + (backend.prefix_len if im is not None else 0) for im, p in specs]
    pages = scattered_pages(lengths, backend.capacity.page_size, backend.capacity.num_pages,
                            seed=len(specs))
    return StepPlan(7, kind, tuple(
        StepRow(seq_id=i, row_slot=i, tokens=tuple(p), position=0, pages=pages[i],
                image=None if im is None else backend.image_ref(im))
        for i, (im, p) in enumerate(specs)))


def written(backend, plan) -> torch.Tensor:
    """bool ``[(N + 1) * page_size]``: the flat KV slots ``plan``'s rows own
    positions of (what the step may write)."""
    ps = backend.capacity.page_size
    mask = torch.zeros((backend.capacity.num_pages + 1) * ps, dtype=torch.bool)
    for r in plan.rows:
        for p in range(r.position, r.position + r.num_tokens):
            mask[r.pages[p // ps] * ps + p % ps] = True
    return mask


def compare(pair, make_plan):
    """Run the plan ``make_plan(backend)`` on both paths from zeroed caches."""
    graphed, eager = pair
    outs = []
    for be in pair:
        be.cache.data.zero_()
        plan = make_plan(be)
        outs.append(step(be, plan))
    (lg, hg, tg), (le, he, te) = outs
    torch.testing.assert_close(lg, le, **CLOSE)
    torch.testing.assert_close(hg, he, **CLOSE)
    assert tg == te
    ps = graphed.capacity.page_size
    own = written(graphed, plan)
    flat_g = graphed.cache.data.flatten(2, 3)  # [L, 2, (N + 1) * ps, KVH, D]
    flat_e = eager.cache.data.flatten(2, 3)
    torch.testing.assert_close(flat_g[:, :, own], flat_e[:, :, own], **CLOSE)
    # I6: nothing outside the rows' own positions but the scratch page.
    others = ~own
    others[graphed.cache.scratch_page * ps:] = False
    assert not flat_g[:, :, others].any() and not flat_e[:, :, others].any()
    assert flat_e[:, :, own].abs().sum() > 0


def test_the_buckets_cover_the_image_rows_and_one_page_count(pair):
    graphed, eager = pair
    p = graphed._prefill
    assert eager._prefill is None and eager._encoder is None
    # Powers of two, and 1.5x steps from one image row (731 tokens) up.
    assert p.tokens == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 3200]
    assert p.rows == [1, 2, 4]  # 3200 // 731: four image rows at most
    assert p.pages * graphed.capacity.page_size >= graphed.prefix_len + 1
    assert (1024, 4) in p.keys() and (16, 1) in p.keys() and (768, 1) in p.keys()
    assert p.key([list(range(740))], np.zeros(1, dtype=np.int64)) == (768, 1)  # one 378-px point row
    assert graphed._encoder.buckets == list(range(1, 17))


@pytest.mark.parametrize("prompt", [[5], [7, 19, 3], [4, 8, 15, 16, 23, 42, 9]])
def test_one_fresh_image_with_an_odd_prompt(pair, prompt):
    image = picture(300, 500, len(prompt))
    compare(pair, lambda be: rows_of(be, [(image, prompt)], StepKind.IMAGE_PREFILL))


def test_three_rows_fresh_and_kept_images_pad_to_four(pair):
    small, large, kept = picture(200, 260, 1), picture(900, 700, 2), picture(400, 640, 3)
    encoded = {}
    for be in pair:  # each backend encodes its own EncodedImage first
        be.cache.data.zero_()
        encoded[be] = be.encode_image(kept)
        plan = rows_of(be, [(encoded[be], [3, 4])], StepKind.IMAGE_PREFILL)
        step(be, plan)
        assert encoded[be].kv is not None
    torch.testing.assert_close(encoded[pair[0]].kv, encoded[pair[1]].kv, **CLOSE)
    compare(pair, lambda be: rows_of(be, [(small, [9]), (encoded[be], [6, 2, 7]),
                                          (large, [1, 2, 3, 4, 5])], StepKind.IMAGE_PREFILL))


def test_two_rows_share_an_image_not_encoded_yet(pair):
    image = picture(500, 300, 4)
    encoded = {be: be.encode_image(image) for be in pair}
    compare(pair, lambda be: rows_of(be, [(encoded[be], [2, 3]), (encoded[be], [5])],
                                      StepKind.IMAGE_PREFILL))
    torch.testing.assert_close(encoded[pair[0]].kv, encoded[pair[1]].kv, **CLOSE)


def test_text_prefills_in_the_image_buckets(pair):
    compare(pair, lambda be: rows_of(be, [(None, [3, 1, 4, 1, 5]), (None, [9, 2]),
                                          (None, list(range(10, 19)))], StepKind.PREFILL))


def test_steps_no_bucket_takes_run_eagerly_and_agree(model, monkeypatch):
    # 1500 tokens: two image rows at most, so three text rows take no graph;
    # pages of 12: P is 64 pages (768 positions) of the context's 86.
    options = {**OPTIONS, "max_prefill_tokens": 1500, "page_size": 12}
    small = tuple(MoondreamBackend(model, **options, **extra)
                  for extra in ({}, {"prefill_graphs": False}))
    assert small[0]._prefill.pages * 12 == 768
    long_prompt = list(range(1, 40)) * 2  # 730 + 78 positions
    cases = [lambda be: rows_of(be, [(None, [i + 1, i + 2, 3]) for i in range(3)],
                                StepKind.PREFILL),
             lambda be: rows_of(be, [(picture(200, 200, 5), long_prompt)], StepKind.IMAGE_PREFILL)]
    for make_plan in cases:
        backends = small
        plan = make_plan(backends[0])
        inputs = [list(r.tokens) if r.image is None else [0] * 730 + list(r.tokens)
                  for r in plan.rows]
        assert backends[0]._prefill.key(inputs, [0] * len(inputs)) is None
        launches = []
        launch = backends[0]._prefill.launch
        monkeypatch.setattr(backends[0]._prefill, "launch",
                            lambda *a: launches.append(a) or launch(*a))
        compare(backends, make_plan)
        assert launches == []


def test_the_encoders_chunks_equal_one_call(pair):
    graphed, _ = pair
    images = [graphed.image_ref(picture(1100, 1300, s)).source for s in (6, 7)]
    assert sum(p.n_crops for p in images) > graphed._encoder.chunk  # two chunks
    got = graphed._encoder.features([p.crops for p in images])
    crops = torch.cat([p.crops for p in images])
    want = graphed.vision.encode(normalize(crops, torch.float32))
    torch.testing.assert_close(got, want, **CLOSE)
    tilings = [p.tiling for p in images]
    torch.testing.assert_close(graphed._encoder.embed([p.crops for p in images], tilings),
                               graphed.vision.embed(crops, tilings), **CLOSE)
