"""The simulated GPU's model and masks: tokens are a pure function of
(prompt, position, previous token) whatever the batch or the timing (I8),
and masks are exact (I9)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.core.protocol import Backend
from bubblefree.core.values import GREEDY, ImageRef, InvalidRequest, SamplingParams, ValueKind
from bubblefree.fake_backend import FakeBackend, FakeModel, HardwareMisuse, stable_hash
from bubblefree.fake_backend.model import sample
from fake_plans import (
    blocking_step, decode, drow, finalize, generation_plans, pages_for, prefill, prow, reference, run,
    tokens_by_seq,
)


# -------------------------------------------------------------------- model
def test_stable_hash_and_default_scores_are_pinned():
    # Literal values: a salted or changed hash would make runs irreproducible.
    assert stable_hash(1, 2, 3) == stable_hash(1, 2, 3) != stable_hash(1, 2, 4)
    assert stable_hash(1, 2, 3) == 0x30736AAC478E72F0
    assert FakeModel().generate((0, 5, 9), 6) == (12, 16, 3, 11, 28, 27)
    hot = SamplingParams(temperature=1.0, seed=3)  # noise from (seed, position, token)
    assert FakeModel().generate((0, 5, 9), 6, hot) == (28, 15, 8, 14, 20, 19)


def test_first_prompt_token_chooses_where_eos_falls():
    model = FakeModel()
    for k in range(1, 6):
        out = model.generate((k, 7, 3), 10)
        assert len(out) == k and out[-1] == model.eos_id and model.eos_id not in out[:-1]
        hot = model.generate((k, 7, 3), 10, SamplingParams(temperature=1.5, seed=k))
        assert len(hot) == k and hot[-1] == model.eos_id
    assert model.eos_id not in model.generate((0, 7, 3), 40)


def test_backend_tokens_follow_the_model_and_the_eos_rule():
    b = FakeBackend()
    prompt = (3, 11, 4)
    pages = pages_for(0, 3, 4)
    plans = [prefill(0, prow(0, prompt, pages))] + [decode(k + 1, drow(0, 3 + k, pages)) for k in range(3)]
    got = tokens_by_seq(plans, run(b, plans, pipelined=True))[0]
    assert got == reference(b.model, prompt, 4)
    assert got[2] == 0 and 0 not in got[:2]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_tokens_do_not_depend_on_batch_mode_or_row_order(data):
    # I8: alone or batched, pipelined or blocking, any row order: same tokens.
    n = data.draw(st.integers(1, 4), label="seqs")
    steps = data.draw(st.integers(0, 4), label="decode steps")
    prompts = [data.draw(st.lists(st.integers(0, 31), min_size=1, max_size=6)) for _ in range(n)]
    samplings = [data.draw(st.sampled_from([GREEDY, SamplingParams(0.8, 1.0, 7), SamplingParams(1.5, 0.6, 3)]))
                 for _ in range(n)]
    orders = [data.draw(st.permutations(range(n))) for _ in range(steps)]
    model = FakeModel()
    batched = generation_plans(prompts, samplings, steps, orders)
    got = tokens_by_seq(batched, run(FakeBackend(), batched, data.draw(st.booleans(), label="pipelined")))
    for i, prompt in enumerate(prompts):
        alone = generation_plans([prompt], [samplings[i]], steps)
        assert tokens_by_seq(alone, run(FakeBackend(), alone, pipelined=False))[0] == got[i]
        assert got[i] == reference(model, prompt, steps + 1, samplings[i])


def test_custom_scores_and_values_are_used():
    def scores(prompt, position, prev):
        return [1.0 if v == (prev + 1) % 8 else 0.0 for v in range(8)]

    model = FakeModel(vocab_size=8, score_fn=scores, value_fn=lambda p, pos, tok, kind: (pos + tok) / 10)
    b = FakeBackend(model=model)
    rows = prefill(0, prow(0, (2, 6), (0,)), prow(1, (5,), (1,)), prow(2, (1,), (2,)))
    out = blocking_step(b, 0, rows, values=(ValueKind.COORD, None, ValueKind.COORD))
    assert out.tokens == (7, 6, 2)
    assert out.values == (0.9, None, 0.3)  # only the rows that asked
    assert blocking_step(FakeBackend(), 0, prefill(0, prow(0, (2, 6), (0,)))).values is None


# -------------------------------------------------------------------- masks
@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 31), min_size=1, max_size=5),
       allowed=st.frozensets(st.integers(0, 31), min_size=1, max_size=6),
       sampling=st.sampled_from([GREEDY, SamplingParams(1.0, 1.0, 1), SamplingParams(2.0, 0.5, 9)]))
def test_masked_rows_pick_only_allowed_tokens(prompt, allowed, sampling):
    b = FakeBackend()
    mask = b.register_mask(allowed)
    plan = prefill(0, prow(0, prompt, (0, 1)), prow(1, prompt, (2, 3), sampling=sampling))
    out = blocking_step(b, 0, plan, masks=(mask, mask))
    assert set(out.tokens) <= allowed
    scores = b.model.scores(tuple(prompt), len(prompt), prompt[-1])
    assert out.tokens[0] == min(allowed, key=lambda v: (-scores[v], v))


def test_sampling_ties_and_top_p():
    assert sample([0.5, 0.9, 0.9], None, GREEDY, 0) == 1
    assert sample([0.5, 0.9, 0.9], {0, 2}, GREEDY, 0) == 2
    # top_p tiny keeps only the best token, whatever the noise.
    assert all(sample([0.1, 3.0, 0.2], None, SamplingParams(5.0, 0.01, s), 4) == 1 for s in range(20))
    drawn = {sample([0.0] * 4, None, SamplingParams(1.0, 1.0, s), 4) for s in range(40)}
    assert drawn == {0, 1, 2, 3}
    # Equal scores, top_p 0.5: the nucleus is the two lowest ids.
    drawn = {sample([0.0] * 4, None, SamplingParams(1.0, 0.5, s), 4) for s in range(40)}
    assert drawn == {0, 1}


def _drawn(scores, **cuts):
    return {sample(scores, None, SamplingParams(1.0, seed=s, **cuts), p) for s in range(10) for p in range(50)}


def test_sampling_cuts_top_k_then_top_p_renormalized_then_min_p():
    scores = [math.log(p) for p in (0.1, 0.4, 0.05, 0.3, 0.15)]
    assert _drawn(scores) == {0, 1, 2, 3, 4}
    assert _drawn(scores, top_k=2) == {1, 3}
    assert _drawn(scores, top_k=1) == {1}
    assert _drawn(scores, top_k=9) == {0, 1, 2, 3, 4}
    # Renormalized over 0.4 and 0.3 the best holds 0.57: top_p 0.55 keeps it alone,
    # where over all five (0.4 of 1) it needs the second too.
    assert _drawn(scores, top_k=2, top_p=0.55) == {1}
    assert _drawn(scores, top_p=0.55) == {1, 3}
    assert _drawn(scores, min_p=0.3) == {1, 3, 4}  # 0.15 of 0.4 is 0.375; 0.1 is 0.25
    assert _drawn(scores, min_p=1.0) == {1}
    assert _drawn(scores, top_k=2, min_p=0.8) == {1}  # 0.3 is 0.75 of 0.4


def test_sampling_top_k_among_allowed_ties_to_the_lowest_ids():
    assert {sample([0.0] * 6, {1, 3, 4, 5}, SamplingParams(1.0, seed=s, top_k=2), 0)
            for s in range(40)} == {1, 3}


def test_satisfies_the_backend_protocol_with_its_capacity():
    b = FakeBackend(num_pages=8, page_size=2, max_rows=3)
    assert isinstance(b, Backend)
    cap = b.capacity
    assert (cap.num_pages, cap.page_size, cap.max_rows, cap.max_seqs, cap.max_prefill_tokens,
            cap.max_context, cap.num_adapter_slots) == (8, 2, 3, 16, 64, 256, 2)
    assert b.vocab_size == 32 and FakeBackend(model=FakeModel(vocab_size=50)).vocab_size == 50


# ---------------------------------------------------------- images, values
def test_an_image_fingerprint_is_stable_and_reads_its_content():
    from PIL import Image

    from bubblefree.fake_backend.images import fingerprint
    assert fingerprint(7) == 7 and fingerprint(b"ab") == fingerprint(bytearray(b"ab")) != fingerprint(b"ba")
    assert fingerprint("x") == 0x44B026B74216712D  # pinned: no salted hash()
    red, blue = Image.new("RGB", (4, 3), "red"), Image.new("RGB", (4, 3), "blue")
    assert fingerprint(red) == fingerprint(red.copy()) != fingerprint(blue)
    assert FakeBackend().image_ref(red).source == fingerprint(red)
    with pytest.raises(InvalidRequest, match="^image: cannot fingerprint an image source of type object$"):
        FakeBackend().image_ref(object())


def test_an_image_changes_the_tokens_and_two_images_differ():
    model = FakeModel()
    text = model.generate((0, 3), 8)
    one, two = (model.generate((0, 3), 8, image=ImageRef(3, source=s)) for s in (1, 2))
    assert len({text, one, two}) == 3
    assert model.generate((2, 3), 8, image=ImageRef(3, source=1))[-1] == model.eos_id  # EOS reads the prompt


def test_a_value_is_a_pure_function_of_the_context_in_its_kinds_range():
    model = FakeModel()
    coord = model.value((1, 2), 2, 2, 5, ValueKind.COORD)
    assert coord == model.value((1, 2), 2, 2, 9, ValueKind.COORD)  # from the hidden state, not the token
    assert coord != model.value((1, 3), 2, 3, 5, ValueKind.COORD) and (coord * 1024).is_integer()
    w, h = model.value((1, 2), 2, 2, 5, ValueKind.SIZE)
    assert 2 ** -10 <= w <= 1 and 2 ** -10 <= h <= 1
    hot = SamplingParams(temperature=1.0, seed=4)
    assert model.value((1, 2), 2, 2, 5, ValueKind.COORD, hot) == model.value((1, 2), 2, 2, 5, ValueKind.COORD, hot)
    assert model.value((1, 2), 2, 2, 5, ValueKind.COORD, hot) != coord


def test_a_value_rows_next_input_is_the_values_marker_on_the_backend_and_in_the_reference():
    b = FakeBackend()
    out = blocking_step(b, 0, prefill(0, prow(0, (0, 3), (0, 1))), values=(ValueKind.COORD,))
    after_value = blocking_step(b, 1, decode(1, drow(0, 2, (0, 1)))).tokens[0]
    plain = FakeBackend()
    blocking_step(plain, 0, prefill(0, prow(0, (0, 3), (0, 1))))
    after_token = blocking_step(plain, 1, decode(1, drow(0, 2, (0, 1)))).tokens[0]
    state = _Asks([ValueKind.COORD, None])
    want = b.model.expect((0, 3), 2, stop_ids=(), state=state)
    assert want.tokens == (out.tokens[0], after_value) and want.values == (out.values[0], None)
    assert after_value != after_token == b.model.generate((0, 3), 2, stop_ids=())[1]


class _Asks:
    def __init__(self, kinds):
        self.kinds = kinds

    def mask_id(self):
        return None

    def value_kind(self):
        return self.kinds.pop(0)

    def advance(self, token, value):
        return False


def test_a_backend_without_a_region_head_or_images_refuses_them():
    b = FakeBackend(images=False, values=False)
    assert not b.capacity.images and not b.capacity.values
    plan = prefill(0, prow(0, (1,), (0,)))
    b.launch(0, plan)
    with pytest.raises(HardwareMisuse, match="without a region head"):
        finalize(b, 0, plan, values=(ValueKind.SIZE,))


# -- image fingerprints and markers: content-sensitive, in range, stable -----
# (survivors of the mutation run: no test compared sources differing only in
# order, length, shape or width, and none pinned the values a replay needs)

def test_fingerprints_of_ints_wrap_to_64_bits():
    from bubblefree.fake_backend.images import fingerprint
    assert fingerprint(5) == 5
    assert fingerprint(2**64 + 5) == 5
    assert fingerprint(-1) == 2**64 - 1


def test_fingerprints_of_sequences_see_order_length_and_parts():
    from bubblefree.fake_backend.images import fingerprint
    assert fingerprint((1, 2)) != fingerprint((2, 1))
    assert fingerprint((1, 2)) != fingerprint((1, 2, 0))
    assert fingerprint((1,)) != fingerprint(1)
    assert fingerprint((b"a", "b")) == fingerprint((b"a", b"b"))  # a str is its UTF-8 bytes
    assert fingerprint(((1, 2), 3)) != fingerprint((1, (2, 3)))


def test_fingerprints_of_images_see_their_shape_and_mode_not_only_their_bytes():
    from PIL import Image

    from bubblefree.fake_backend.images import fingerprint
    wide = Image.frombytes("L", (2, 1), b"\x01\x02")
    tall = Image.frombytes("L", (1, 2), b"\x01\x02")
    palette = Image.frombytes("P", (2, 1), b"\x01\x02")
    assert len({fingerprint(wide), fingerprint(tall), fingerprint(palette)}) == 3
    assert fingerprint(wide) == fingerprint(Image.frombytes("L", (2, 1), b"\x01\x02"))


def test_markers_are_negative_below_every_value_marker_and_distinct():
    from bubblefree.fake_backend.images import _SPAN, image_markers, value_marker
    a, b = image_markers(7, 50), image_markers(8, 50)
    assert all(-2 * _SPAN <= m <= -1 - _SPAN for m in a + b)  # image markers: their own band
    assert len(set(a)) == 50 and not set(a) & set(b)
    values = [value_marker(ValueKind.COORD, x / 7) for x in range(7)] + [
        value_marker(ValueKind.SIZE, (0.5, x / 7 + 0.01)) for x in range(7)]
    assert all(-_SPAN <= m <= -1 for m in values) and len(set(values)) == 14
    assert value_marker(ValueKind.COORD, 0.25) != value_marker(ValueKind.SIZE, (0.25, 0.25))


def test_fingerprints_and_markers_are_the_recorded_ones():
    """Replays and recorded seeds depend on these exact values: a change to
    the hashing (a salt, an order) must be deliberate and update them."""
    from bubblefree.fake_backend.images import fingerprint, image_markers, value_marker
    assert fingerprint((1, 2)) == 4468780626374788559
    assert image_markers(7, 3) == (-1349189357350, -1633669087025, -1150561488259)
    assert value_marker(ValueKind.COORD, 0.25) == -325813509135
    assert value_marker(ValueKind.SIZE, (0.5, 0.125)) == -634474092656


def test_fingerprints_of_arrays_see_their_shape():
    import numpy as np

    from bubblefree.fake_backend.images import fingerprint
    flat = np.arange(6, dtype=np.uint8)
    assert len({fingerprint(flat), fingerprint(flat.reshape(2, 3)), fingerprint(flat.reshape(3, 2))}) == 3
    assert fingerprint(flat.reshape(2, 3)) == fingerprint(np.arange(6, dtype=np.uint8).reshape(2, 3))


def test_the_model_refuses_bad_shapes_naming_them_and_takes_the_smallest():
    smallest = FakeModel(vocab_size=2, eos_id=1)
    assert set(smallest.generate((0, 1), 8, stop_ids=())) <= {0, 1}
    with pytest.raises(ValueError, match=r"^vocab_size must be >= 2, got 1$"):
        FakeModel(vocab_size=1, eos_id=0)
    with pytest.raises(ValueError, match=r"^eos_id must be in \[0, 4\), got 4$"):
        FakeModel(vocab_size=4, eos_id=4)
    with pytest.raises(ValueError, match=r"^prompt must hold at least one token$"):
        FakeModel().expect((), 3)


def test_the_expected_tokens_stop_at_the_stop_ids_given():
    model = FakeModel()
    free = model.generate((3, 4), 12, stop_ids=())  # nothing stops it: its max_tokens
    assert len(free) == 12
    stop = free[4]
    cut = free[:free.index(stop) + 1]
    assert model.generate((3, 4), 12, GREEDY, {stop}) == cut  # the stop id kept, nothing after it
    assert model.expect((3, 4), 12, stop_ids={stop}).tokens == cut


def test_sampled_values_follow_the_seed_and_a_value_fn_sees_the_prompt():
    model, prompt = FakeModel(), (3, 1, 4)
    by_seed = {seed: [model.value(prompt, p, 1, 2, ValueKind.COORD, SamplingParams(temperature=1.0, seed=seed))
                      for p in range(3, 23)] for seed in (1, 2)}
    assert by_seed[1] != by_seed[2]
    custom = FakeModel(value_fn=lambda prompt, position, token, kind: len(prompt) / 10)
    assert custom.value(prompt, 3, 1, 2, ValueKind.COORD) == pytest.approx(0.3)
