"""Sampling: seeded per request and position (reproducible, independent of
the batch, I8 with sampling on), top-p and temperature honoured, skill masks
never violated (I9's device half)."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubblefree.core.values import SamplingParams
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.sampling import (Draw, Draws, MaskTable, mix32, sample_tokens,
                                               uniforms, unit, vocab_hash)
from bubblefree.cuda_backend.tiny import tiny_model

V = 64
SALT = vocab_hash(V, torch.device("cpu"))


def draw(logits, *, temperature, top_p=1.0, top_k=0, min_p=0.0, seed=0, position=0, mask_ids=None,
         table=None, greedy_only=False, kind=None):
    """``sample_tokens`` with per-row values given as scalars or lists; seeds
    are split into 32-bit halves as the backend does on the host. ``kind``:
    the ``Draw`` (default: ``CUT``, which every row may take)."""
    b = logits.shape[0]

    def rows(x, dtype):
        return torch.tensor(x if isinstance(x, list) else [x] * b, dtype=dtype)
    seeds = [s % 2**64 for s in (seed if isinstance(seed, list) else [seed] * b)]
    table = table if table is not None else torch.ones(1, V, dtype=torch.bool)
    draws = Draws(rows(temperature, torch.float32), rows(top_p, torch.float32), rows(top_k, torch.long),
                  rows(min_p, torch.float32), rows([s & 0xFFFFFFFF for s in seeds], torch.long),
                  rows([s >> 32 for s in seeds], torch.long), rows(position, torch.long))
    kind = Draw.GREEDY if greedy_only else kind or Draw.CUT
    return sample_tokens(logits, table, rows(0, torch.long) if mask_ids is None else mask_ids, draws,
                         SALT, kind)


def test_mix32_matches_the_reference_hash():
    """lowbias32 on known inputs, computed in plain Python (no overflow)."""
    def ref(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    xs = [0, 1, 2, 0xFFFFFFFF, 0x12345678, 0x80000000, 987654321]
    assert mix32(torch.tensor(xs)).tolist() == [ref(x) for x in xs]


def test_uniforms_are_uniform_and_keyed():
    u = uniforms(torch.tensor([7]), torch.tensor([0]), torch.tensor([3]), vocab_hash(50_000, "cpu"))
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    other = uniforms(torch.tensor([7]), torch.tensor([0]), torch.tensor([4]),
                     vocab_hash(50_000, "cpu"))
    assert (u != other).float().mean() > 0.99  # another position, another stream


def test_the_hashs_extremes_stay_inside_the_unit_interval_with_finite_noise():
    u = unit(torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1]))
    assert 0.0 < u.min() and u.max() < 1.0
    noise = -torch.log(-torch.log(u))
    assert torch.isfinite(noise).all()


def test_a_draw_where_a_tokens_hash_is_at_its_largest_keeps_to_the_mask():
    """Seeds where some token's hash has its top 24 bits set (where u was
    1.0, its noise +inf and a masked token's score NaN): a row masked to
    {0, 1, 2} draws one of them, and unmasked draws the token that holds
    the probability."""
    vocab, position = 49152, 10
    salt = vocab_hash(vocab, torch.device("cpu"))
    seeds = torch.arange(600)
    key = mix32(seeds ^ mix32(torch.zeros_like(seeds) ^ mix32(torch.tensor(position))))
    hits = [int(s) for s, k in zip(seeds, key) if ((mix32(k ^ salt) >> 8) == (1 << 24) - 1).any()]
    assert hits  # the case is there to be drawn
    table = torch.ones(2, vocab, dtype=torch.bool)
    table[1] = False
    table[1, :3] = True
    logits = torch.full((len(hits), vocab), -30.0)
    logits[:, 0] = 30.0
    b = len(hits)
    zero = torch.zeros(b, dtype=torch.long)
    args = (Draws(torch.ones(b), torch.ones(b), zero, torch.zeros(b), torch.tensor(hits), zero,
                  torch.full((b,), position)), salt, Draw.CUT)
    masked = sample_tokens(logits, table, torch.ones(b, dtype=torch.long), *args)
    assert set(masked.tolist()) <= {0, 1, 2}
    assert sample_tokens(logits, table, zero, *args).tolist() == [0] * b


def test_greedy_is_argmax_and_temperature_zero_rows_stay_greedy():
    logits = torch.randn(5, V)
    assert draw(logits, temperature=0.0, greedy_only=True).tolist() == logits.argmax(-1).tolist()
    out = draw(logits, temperature=[0.0, 1.0, 0.0, 2.0, 0.0], seed=5)
    assert out[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist()


@given(st.integers(0, 2**64 - 1), st.integers(0, 5000), st.integers(1, 7))
def test_a_rows_token_does_not_depend_on_its_batch(seed, position, others):
    torch.manual_seed(seed % 1000)
    row = torch.randn(1, V) * 3
    alone = draw(row, temperature=0.9, top_p=0.8, seed=seed, position=position)
    crowd = torch.cat([torch.randn(others, V), row])
    seeds = [seed * 7 + i for i in range(others)] + [seed]  # the row is last in the batch
    got = draw(crowd, temperature=0.9, top_p=0.8, seed=seeds, position=position)
    assert got[-1].item() == alone.item()


def test_reproducible_and_seed_dependent():
    logits = torch.zeros(1, V)  # uniform: the draw is all noise
    a = [draw(logits, temperature=1.0, seed=11, position=p).item() for p in range(40)]
    b = [draw(logits, temperature=1.0, seed=11, position=p).item() for p in range(40)]
    c = [draw(logits, temperature=1.0, seed=12, position=p).item() for p in range(40)]
    assert a == b and a != c
    assert len(set(a)) > 20  # positions draw different tokens


def test_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    counts = torch.bincount(torch.cat([draw(logits, temperature=1.0, seed=s, position=p)
                                       for s in range(20) for p in range(200)]), minlength=V)
    freq = counts[:3].float() / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    seen = {draw(logits, temperature=1.0, top_p=0.7, seed=s, position=p).item()
            for s in range(10) for p in range(50)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.7; 0.15 never drawn
    tiny = {draw(logits, temperature=1.0, top_p=1e-6, seed=s).item() for s in range(50)}
    assert tiny == {0}


def _seen(logits, **cuts):
    """The tokens drawn over 10 seeds at 50 positions each."""
    return {draw(logits, temperature=1.0, seed=s, position=p, **cuts).item()
            for s in range(10) for p in range(50)}


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15] + [1e-9] * (V - 5)]))
    assert _seen(logits, top_k=2) == {1, 3}
    assert _seen(logits, top_k=1) == {1}
    assert _seen(logits, top_k=3) == {1, 3, 4}
    assert _seen(logits, top_k=10**6) == _seen(logits) == {0, 1, 2, 3, 4}  # past the vocabulary: no cut


def test_top_k_ties_keep_the_lowest_ids_as_greedy_does():
    logits = torch.zeros(1, V)  # every token equally likely
    assert _seen(logits, top_k=3) == {0, 1, 2}


def test_top_k_counts_only_allowed_tokens():
    table = torch.ones(2, V, dtype=torch.bool)
    table[1, :2] = False  # the two most likely are masked out
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05] + [1e-9] * (V - 5)]))
    seen = {draw(logits, temperature=1.0, top_k=2, seed=s, position=p, mask_ids=torch.tensor([1]),
                 table=table).item() for s in range(10) for p in range(50)}
    assert seen == {2, 3}


def test_top_p_runs_on_what_top_k_left_renormalized():
    # Alone, top_p 0.6 keeps 0.35 and 0.3 (0.65 with the second). After
    # top_k 3 the three hold 0.41, 0.35 and 0.24 of what is left: 0.6 still
    # needs the first two, not the third.
    logits = torch.log(torch.tensor([[0.35, 0.3, 0.15, 0.2] + [1e-9] * (V - 4)]))
    assert _seen(logits, top_p=0.6) == {0, 1}
    assert _seen(logits, top_k=3, top_p=0.6) == {0, 1}
    # Renormalized, 0.35 / (0.35 + 0.3) = 0.54 reaches 0.5: the best alone.
    # Without renormalizing, 0.35 would not reach 0.5 and both would stay.
    assert _seen(logits, top_k=2, top_p=0.5) == {0}
    assert _seen(logits, top_p=0.5) == {0, 1}


def test_min_p_drops_what_is_under_its_share_of_the_best():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)]))
    assert _seen(logits, min_p=0.49) == {0, 1, 2}  # 0.2 is half of 0.4
    assert _seen(logits, min_p=0.51) == {0, 1}
    assert _seen(logits, min_p=1.0) == {0}
    assert _seen(logits, min_p=0.2) == {0, 1, 2, 3}  # 1e-9 does not reach 0.08
    # A share of the best: the same whether top_k cut first or not.
    assert _seen(logits, top_k=3, min_p=0.51) == {0, 1}


def test_the_cuts_follow_the_temperature():
    # At temperature 2 the probabilities flatten: 0.4 vs 0.1 becomes a ratio
    # of 2, not 4, so min_p 0.4 keeps the last token, which it drops at 1.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)]))
    hot = {draw(logits, temperature=2.0, min_p=0.4, seed=s, position=p).item()
           for s in range(10) for p in range(50)}
    assert hot == {0, 1, 2, 3}
    assert _seen(logits, min_p=0.4) == {0, 1, 2}


def test_frequencies_inside_the_cuts_follow_the_renormalized_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)]))
    counts = torch.bincount(torch.cat([draw(logits, temperature=1.0, top_k=3, seed=s, position=p)
                                       for s in range(20) for p in range(200)]), minlength=V)
    freq = counts[:3].float() / counts.sum()
    assert counts[3:].sum() == 0
    assert torch.allclose(freq, torch.tensor([4 / 9, 3 / 9, 2 / 9]), atol=0.03)


@given(st.integers(0, 2**32), st.integers(1, 6), st.floats(1e-5, 100), st.booleans())
def test_a_plain_draw_takes_the_tokens_the_cut_one_takes_without_a_cut(seed, b, temperature, masked):
    """``Draw.PLAIN`` (no sort) for rows with no cut: what ``Draw.CUT`` draws,
    greedy rows beside them included, masks kept."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, V, generator=gen) * 4
    table = torch.ones(2, V, dtype=torch.bool)
    table[1, ::3] = False
    mask_ids = torch.tensor([int(masked and i % 2 == 0) for i in range(b)])
    temps = [0.0 if i % 3 == 2 else temperature for i in range(b)]
    seeds = [seed + i for i in range(b)]
    plain, cut = (draw(logits, temperature=temps, seed=seeds, position=seed % 97, mask_ids=mask_ids,
                       table=table, kind=kind) for kind in (Draw.PLAIN, Draw.CUT))
    assert plain.tolist() == cut.tolist()
    assert all(table[m, t] for m, t in zip(mask_ids.tolist(), plain.tolist()))


def test_greedy_rows_ignore_the_cuts():
    logits = torch.randn(4, V)
    out = draw(logits, temperature=[0.0, 0.0, 1.0, 0.0], top_k=[2, 0, 1, 5], min_p=[0.9, 0.0, 0.0, 1.0],
               top_p=[1e-5, 1.0, 1.0, 0.5])
    assert out[[0, 1, 3]].tolist() == logits.argmax(-1)[[0, 1, 3]].tolist()
    assert out[2].item() == logits[2].argmax().item()  # top_k 1: the best, drawn


def _kept(logits, temperature, top_k, top_p, min_p):
    """The tokens a draw may take, by ``SamplingParams``' rule in float64."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = sorted(range(len(probs)), key=lambda v: (-probs[v].item(), v))
    order = order[:top_k] if top_k else order
    mass = probs[order] / probs[order].sum()
    before = torch.cumsum(mass, 0) - mass
    return {v for v, m, b in zip(order, mass.tolist(), before.tolist())
            if (top_p == 1.0 or b < top_p) and m >= min_p * mass[0].item()}


@pytest.mark.parametrize("case", range(12))
def test_the_device_and_the_simulated_gpu_draw_from_the_same_tokens(case):
    """Both samplers, for random logits and cuts, draw only the rule's
    tokens, and each of them that holds 2% or more of what stays."""
    from bubblefree.fake_backend.model import sample
    gen = torch.Generator().manual_seed(case)
    logits = torch.randn(V, generator=gen) * 2.5
    temperature = (0.5, 1.0, 1.7)[case % 3]
    top_k, top_p, min_p = (0, 5, 12, 30)[case % 4], (1.0, 0.8, 0.5)[case % 3 - 1], (0.0, 0.1, 0.02)[case % 3]
    kept = _kept(logits, temperature, top_k, top_p, min_p)
    params = [SamplingParams(temperature, top_p, s, top_k=top_k, min_p=min_p) for s in range(600)]
    device = {draw(logits[None], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   seed=p.seed, position=3).item() for p in params}
    fake = {sample(logits.tolist(), None, p, 3) for p in params}
    probs = torch.softmax(logits.double() / temperature, -1)
    likely = {v for v in kept if probs[v] >= 0.02 * probs[sorted(kept)].sum()}
    assert likely and likely <= device <= kept and likely <= fake <= kept


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_masks_are_never_violated(temperature):
    table = MaskTable(V, torch.device("cpu"), capacity=2)
    allowed = [frozenset({3, 9}), frozenset({V - 1}), frozenset(range(10, 20))]
    ids = [table.register(a)[0] for a in allowed]
    logits = torch.randn(30, V) * 5
    mask_ids = torch.tensor([ids[i % 3] for i in range(30)])
    out = draw(logits, temperature=temperature, seed=3, mask_ids=mask_ids, table=table.table,
               greedy_only=temperature == 0)
    for i, t in enumerate(out.tolist()):
        assert t in allowed[i % 3]


def test_mask_table_dedupes_grows_and_rejects_bad_sets():
    table = MaskTable(V, torch.device("cpu"), capacity=2)
    first, grew = table.register(frozenset({1, 2}))
    assert (first, grew) == (1, False)
    assert table.register(frozenset({2, 1})) == (1, False)
    second, grew = table.register(frozenset({5}))
    assert grew and table.table.shape[0] == 4
    assert table.table[first].nonzero().flatten().tolist() == [1, 2]
    assert table.table[second].nonzero().flatten().tolist() == [5]
    assert table.table[0].all()  # the unconstrained row
    with pytest.raises(ValueError, match="empty"):
        table.register(frozenset())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        table.register(frozenset({V}))


def test_backend_sampling_is_reproducible_and_masked():
    model = tiny_model("llama", seed=4)
    be = CudaBackend(model, page_size=4, num_pages=64, max_rows=4, max_seqs=8,
                     max_prefill_tokens=64, min_graph_context=8, mask_capacity=2)
    allowed = frozenset(range(40, 60))
    mask = be.register_mask(allowed)
    for extra in ({1}, {2}, {3}):  # the table grows past its capacity
        be.register_mask(frozenset(extra))
    prompts = [[5, 6, 7], [8, 9], [10]]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (1, 2, 3)]
    a = generate(be, prompts, 8, sampling=params, mask_ids=[None, mask, None])
    b = generate(be, prompts, 8, sampling=params, mask_ids=[None, mask, None], page_seed=9,
                 row_slots=[7, 5, 0])
    assert a == b  # other pages, other row slots: same draws
    assert all(t in allowed for t in a[1])
    alone = generate(be, [prompts[2]], 8, sampling=[params[2]])
    assert alone[0] == a[2]  # batch-independent through the whole backend
    # The cuts go through the packing and the sampling graphs: one token left is greedy's.
    greedy = generate(be, prompts, 8, mask_ids=[None, mask, None])
    one = [SamplingParams(temperature=1.0, seed=s, top_k=1 if s % 2 else 0, min_p=0.0 if s % 2 else 1.0)
           for s in (1, 2, 3)]
    assert generate(be, prompts, 8, sampling=one, mask_ids=[None, mask, None]) == greedy
    assert generate(be, prompts, 8, sampling=params, mask_ids=[None, mask, None]) != greedy
    # A draw with no cut (no sort) takes what the cut path takes with a cut that drops nothing.
    plain = [SamplingParams(temperature=1.3, seed=s) for s in (4, 5, 6)]
    wide = [attrs.evolve(p, top_k=be.vocab_size) for p in plain]
    assert generate(be, prompts, 8, sampling=plain, mask_ids=[None, mask, None]) == \
        generate(be, prompts, 8, sampling=wide, mask_ids=[None, mask, None]) != greedy
