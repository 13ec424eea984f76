"""The simulated GPU's model and masks: tokens are a pure function of
(prompt, position, previous token) whatever the batch or the timing (I8),
and masks are exact (I9)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.core.protocol import Backend
from bubblefree.core.values import GREEDY, SamplingParams, ValueKind
from bubblefree.fake_backend import FakeBackend, FakeModel, stable_hash
from bubblefree.fake_backend.model import sample
from fake_plans import (
    blocking_step, decode, drow, generation_plans, pages_for, prefill, prow, reference, run, tokens_by_seq,
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


def test_satisfies_the_backend_protocol_with_its_capacity():
    b = FakeBackend(num_pages=8, page_size=2, max_rows=3)
    assert isinstance(b, Backend)
    cap = b.capacity
    assert (cap.num_pages, cap.page_size, cap.max_rows, cap.max_seqs, cap.max_prefill_tokens,
            cap.max_context, cap.num_adapter_slots) == (8, 2, 3, 16, 64, 256, 2)
    assert b.vocab_size == 32 and FakeBackend(model=FakeModel(vocab_size=50)).vocab_size == 50
