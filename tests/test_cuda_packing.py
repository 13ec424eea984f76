"""Properties of the metadata a step's graphs read (pure numpy, no model):
every real token, position, page and row lands where the graph looks for
it, and every padded slot points at the scratch row or scratch page, for
any plan the capacity admits. A wrong offset here would make a graph read
another sequence's pages."""

from __future__ import annotations

import attrs
import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubblefree.core.protocol import Capacity
from bubblefree.core.values import SamplingParams, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.graphs import batch_buckets, bucket, page_buckets
from bubblefree.cuda_backend.kernel_config import Dispatch, KernelConfig
from bubblefree.cuda_backend.kv_cache import PagedKVCache
from bubblefree.cuda_backend.runner import META_HEAD, ModelRunner, staging_size
from bubblefree.cuda_backend.sampling import PARTS, UNCONSTRAINED, Draw, pack_sampling, unpack_sampling
from bubblefree.cuda_backend.token_prefill import TokenPrefill

CAP = Capacity(num_pages=40, page_size=4, max_rows=6, max_seqs=8, max_prefill_tokens=48,
               max_context=32)
CACHE = PagedKVCache(layers=1, kv_heads=1, head_dim=2, num_pages=CAP.num_pages,
                     page_size=CAP.page_size, dtype=torch.float32, device=torch.device("cpu"))
RUNNER = ModelRunner(None, CACHE, CAP, torch.device("cpu"), KernelConfig())
MAX_PAGES = -(-CAP.max_context // CAP.page_size)


@st.composite
def rows(draw, prefill: bool):
    n = draw(st.integers(1, CAP.max_rows))
    slots = draw(st.permutations(range(CAP.max_seqs)))[:n]
    out = []
    for i in range(n):
        start = draw(st.integers(0, CAP.max_context - 1))
        length = draw(st.integers(1, min(8, CAP.max_context - start))) if prefill else 1
        pages = tuple(draw(st.lists(st.integers(0, CAP.num_pages - 1),
                                    min_size=-(-(start + length) // CAP.page_size),
                                    max_size=MAX_PAGES)))
        tokens = tuple(draw(st.lists(st.integers(0, 99), min_size=length, max_size=length)))
        out.append(StepRow(seq_id=i, row_slot=slots[i], tokens=tokens if prefill else (),
                           position=start, pages=pages))
    return tuple(out)


@given(rows(prefill=False))
def test_decode_metadata_sits_at_fixed_offsets(plan_rows):
    plan = StepPlan(0, StepKind.DECODE, plan_rows)
    b = bucket(len(plan_rows), batch_buckets(CAP.max_rows))
    p = bucket(RUNNER.pages_needed(plan), page_buckets(MAX_PAGES))
    staging = np.full(staging_size(CAP), -7, dtype=np.int64)
    count = RUNNER.pack_decode(plan, staging, b, p, slot=1)
    slots, positions, table = RUNNER.meta_views(staging, b, p)
    assert count == META_HEAD + 2 * CAP.max_rows + b * p  # one copy covers every part
    assert list(RUNNER.meta_slot(staging)) == [1]  # the step's slot, in the header
    assert slots.ctypes.data % 16 == positions.ctypes.data % 16 == table.ctypes.data % 16 \
        == staging.ctypes.data % 16  # the header keeps the parts' alignment
    for i, r in enumerate(plan_rows):
        assert slots[i] == r.row_slot and positions[i] == r.position
        used = r.position // CAP.page_size + 1  # the pages the kernel may read
        assert list(table[i, :used]) == list(r.pages[:used])
        kept = r.pages[:p]  # and the rest of its row: its own pages, then the scratch page
        assert list(table[i]) == list(kept) + [CACHE.scratch_page] * (p - len(kept))
    assert (slots[len(plan_rows):] == RUNNER.scratch_row).all()
    assert (positions[len(plan_rows):] == 0).all()
    assert (table[len(plan_rows):] == CACHE.scratch_page).all()


@given(rows(prefill=True))
def test_token_rows_carry_each_prompt_and_pad_into_the_scratch_row(plan_rows):
    tp = TokenPrefill(None, CACHE, CAP.max_prefill_tokens, CAP.max_rows, MAX_PAGES,
                      torch.device("cpu"), Dispatch())
    assert staging_size(CAP) >= tp.size
    plan = StepPlan(0, StepKind.PREFILL, plan_rows)
    total = sum(len(r.tokens) for r in plan_rows)
    t, b = bucket(total, tp.tokens), bucket(len(plan_rows), tp.rows)
    assert (t, b) in tp.keys()  # a graph exists for every bucket a plan can land in
    staging = np.full(staging_size(CAP), -7, dtype=np.int64)
    tp.pack(plan, staging, t, b)
    tokens, positions, row_of, last, table = tp.views(staging, t, b)
    at = 0
    for i, r in enumerate(plan_rows):
        n = len(r.tokens)
        assert list(tokens[at:at + n]) == list(r.tokens)
        assert list(positions[at:at + n]) == list(range(r.position, r.position + n))
        assert (row_of[at:at + n] == i).all() and last[i] == at + n - 1
        assert list(table[i, :len(r.pages)]) == list(r.pages)
        assert (table[i, len(r.pages):] == CACHE.scratch_page).all()
        at += n
    assert (row_of[at:] == b).all() and (positions[at:] == 0).all()  # padded tokens
    assert (table[len(plan_rows):] == CACHE.scratch_page).all()  # padded rows + scratch row
    assert (last[len(plan_rows):] == 0).all()
    keys = sum(len(r.tokens) * r.position + len(r.tokens) * (len(r.tokens) + 1) // 2
               for r in plan_rows)
    assert tp.fits(plan) == (keys <= tp.key_budget)


@given(st.integers(1, 8192), st.one_of(st.none(), st.integers(1, 8192)), st.integers(1, 8192))
def test_token_buckets_hold_every_count_and_add_midpoints_only_from_fine_from(max_tokens, fine_from, n):
    from bubblefree.cuda_backend.token_prefill import token_buckets
    sizes = token_buckets(max_tokens, fine_from=fine_from)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
    assert set(token_buckets(max_tokens)) <= set(sizes)
    extra = set(sizes) - set(token_buckets(max_tokens))
    assert all(fine_from is not None and e >= fine_from and (e // 3) & (e // 3 - 1) == 0 and e % 3 == 0
               for e in extra), extra  # each a 1.5 × 2^k at or above fine_from
    if n <= max_tokens:
        b = bucket(n, sizes)
        assert n <= b
        if fine_from is not None and n >= max(fine_from, 16):
            assert b < 1.5 * n  # from fine_from up, no row pads by half or more


def test_an_image_row_of_moondream2_pads_to_768_not_1024():
    from bubblefree.cuda_backend.token_prefill import token_buckets
    sizes = token_buckets(4096, fine_from=730)
    assert bucket(740, sizes) == 768 and bucket(2 * 740, sizes) == 1536 and bucket(4 * 740, sizes) == 3072


@st.composite
def sampled_rows(draw):
    """Decode rows with any sampling a request may ask for, and their mask ids."""
    plan_rows = draw(rows(prefill=False))
    params = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.0, 0.7, 1e-5, 100.0]),
                       top_p=st.sampled_from([1.0, 0.9, 1e-5]), seed=st.integers(0, 2**64 - 1),
                       top_k=st.sampled_from([0, 1, 40, 2**31 - 1]), min_p=st.sampled_from([0.0, 0.05, 1.0]))
    plan_rows = tuple(attrs.evolve(r, sampling=draw(params)) for r in plan_rows)
    masks = tuple(draw(st.lists(st.one_of(st.none(), st.integers(1, 9)),
                                min_size=len(plan_rows), max_size=len(plan_rows))))
    return plan_rows, masks


@given(sampled_rows(), st.integers(0, 3))
def test_sampling_inputs_sit_in_their_columns_and_pad_to_greedy_scratch_rows(drawn, extra):
    plan_rows, masks = drawn
    n = len(plan_rows)
    b = n + extra
    a = np.full(PARTS * b + 8, -7, dtype=np.int64)
    kind = pack_sampling(a, plan_rows, masks, b, RUNNER.scratch_row)
    slots, mask_ids, draws = unpack_sampling(torch.from_numpy(a.copy()), b)
    slots, mask_ids = slots.tolist(), mask_ids.tolist()
    temperature, top_p, top_k, min_p, seed_lo, seed_hi, position = (t.tolist() for t in draws)
    assert slots == [r.row_slot for r in plan_rows] + [RUNNER.scratch_row] * extra
    assert mask_ids == [UNCONSTRAINED if m is None else m for m in masks] + [UNCONSTRAINED] * extra
    seeds = [lo | hi << 32 for lo, hi in zip(seed_lo, seed_hi)]
    assert seeds == [r.sampling.seed for r in plan_rows] + [0] * extra
    assert position == [r.position + 1 for r in plan_rows] + [0] * extra  # a decode row samples the next
    assert temperature == [np.float32(r.sampling.temperature) for r in plan_rows] + [0.0] * extra
    assert top_p == [np.float32(r.sampling.top_p) for r in plan_rows] + [1.0] * extra
    drawn = [r.sampling for r in plan_rows if r.sampling.temperature]
    cut = any(p.top_p < 1 or p.top_k or p.min_p for p in drawn)
    assert kind is (Draw.CUT if cut else Draw.PLAIN if drawn else Draw.GREEDY)
    if drawn:
        assert top_k == [r.sampling.top_k for r in plan_rows] + [0] * extra
        assert min_p == [np.float32(r.sampling.min_p) for r in plan_rows] + [0.0] * extra
    else:  # a greedy step's rows take no cut: not written
        assert top_k == [0] * b and min_p == [0.0] * b
    assert (a[PARTS * b:] == -7).all()  # nothing past the bucket's columns


def test_a_row_slot_s_new_pages_replace_the_ones_packed_before():
    # pack_decode keeps each row slot's page table on the host between
    # steps; a slot that a new sequence took (new pages) must not keep the
    # old ones, nor their tail where the new table is shorter.
    runner = ModelRunner(None, CACHE, CAP, torch.device("cpu"), KernelConfig())
    staging = np.zeros(staging_size(CAP), dtype=np.int64)
    for pages in ((3, 4, 5, 6), (7,), (7,)):
        row = StepRow(seq_id=0, row_slot=2, tokens=(), position=0, pages=pages)
        runner.pack_decode(StepPlan(0, StepKind.DECODE, (row,)), staging, 1, 4)
        _, _, table = runner.meta_views(staging, 1, 4)
        assert list(table[0]) == list(pages) + [CACHE.scratch_page] * (4 - len(pages))
