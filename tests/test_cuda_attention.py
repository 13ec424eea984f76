"""Paged attention equals transformers' own eager attention (float32, random
inputs, rows of mixed lengths, pages scattered, some rows continuing a
prefix already in the cache, with and without a sliding window)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from bubblefree.core.protocol import Capacity
from bubblefree.core.values import StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.attention import CONTEXT_KWARG, paged_attention_forward
from bubblefree.cuda_backend.drive import scattered_pages
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.kv_cache import PagedKVCache
from bubblefree.cuda_backend.runner import ModelRunner, staging_size

H, KVH, D, PS, PAGES = 6, 2, 8, 4, 64


class Layer(torch.nn.Module):
    """What attention functions read off the module."""

    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.layer_idx, self.num_key_value_groups, self.is_causal = layer_idx, H // KVH, True


def setup(seed: int, ctx_lens: list[int], max_rows: int = 8):
    torch.manual_seed(seed)
    cap = Capacity(num_pages=PAGES, page_size=PS, max_rows=max_rows, max_seqs=16,
                   max_prefill_tokens=128, max_context=96)
    cache = PagedKVCache(layers=2, kv_heads=KVH, head_dim=D, num_pages=PAGES, page_size=PS,
                         dtype=torch.float32, device=torch.device("cpu"))
    cache.data.normal_()  # stale garbage everywhere: masking must hide it
    runner = ModelRunner(None, cache, cap, torch.device("cpu"), KernelConfig())
    pages = scattered_pages(ctx_lens, PS, PAGES, seed)
    return cap, cache, runner, pages


def reference(layer, q, k_all, v_all, q_positions, window):
    """Eager attention of one row: q ``[1, H, S, D]`` at ``q_positions``
    against all of its keys ``[1, KVH, L, D]``."""
    length = k_all.shape[2]
    j = torch.arange(length)
    allowed = j[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= j[None, :] > q_positions[:, None] - window
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
    out, _ = eager_attention_forward(layer, q, k_all, v_all, mask, scaling=D ** -0.5)
    return out[0]  # [S, H, D]


def cached_kv(cache, layer, pages, n):
    """The first ``n`` positions of a row's keys and values ``[1, KVH, n, D]``."""
    keys, values = cache.layer(layer)
    idx = torch.tensor([pages[p // PS] * PS + p % PS for p in range(n)], dtype=torch.long)
    return keys[idx].transpose(0, 1)[None], values[idx].transpose(0, 1)[None]


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_matches_eager(window):
    lens, prefix = [5, 1, 12, 7, 3], [0, 3, 0, 9, 17]
    cap, cache, runner, pages = setup(0, [a + b for a, b in zip(lens, prefix)])
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(1,) * n, position=p0, pages=pages[i])
                 for i, (n, p0) in enumerate(zip(lens, prefix)))
    plan = StepPlan(0, StepKind.PREFILL, rows)
    staging = np.zeros(staging_size(cap), dtype=np.int64)
    count, shape = runner.pack_prefill(plan, staging)
    *_, ctx = runner.prefill_inputs(torch.from_numpy(staging[:count]), shape)
    t = sum(lens)
    q, k, v = torch.randn(1, H, t, D), torch.randn(1, KVH, t, D), torch.randn(1, KVH, t, D)
    layer = Layer(1)
    before = [cached_kv(cache, 1, pages[i], prefix[i]) for i in range(len(rows))]
    out, _ = paged_attention_forward(layer, q, k, v, None, scaling=D ** -0.5,
                                     sliding_window=window, **{CONTEXT_KWARG: ctx})
    assert out.shape == (1, t, H, D)
    start = 0
    for i, (n, p0) in enumerate(zip(lens, prefix)):
        k_all = torch.cat([before[i][0], k[:, :, start:start + n]], dim=2)
        v_all = torch.cat([before[i][1], v[:, :, start:start + n]], dim=2)
        want = reference(layer, q[:, :, start:start + n], k_all, v_all,
                         torch.arange(p0, p0 + n), window)
        torch.testing.assert_close(out[0, start:start + n], want, rtol=1e-5, atol=1e-5)
        # the new keys landed in the row's own pages, at their positions
        k_now, _ = cached_kv(cache, 1, pages[i], p0 + n)
        torch.testing.assert_close(k_now, k_all)
        start += n


@pytest.mark.parametrize("window", [None, 4])
def test_decode_matches_eager(window):
    ctx_lens = [1, 6, 17, 9, 30]
    cap, cache, runner, pages = setup(1, ctx_lens)
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(), position=n - 1, pages=pages[i])
                 for i, n in enumerate(ctx_lens))
    plan = StepPlan(0, StepKind.DECODE, rows)
    b, p = 8, 16  # padded: 3 padded rows, pages past each row's own
    staging = np.zeros(staging_size(cap), dtype=np.int64)
    count = runner.pack_decode(plan, staging, b, p)
    runner.decode_meta[:count] = torch.from_numpy(staging[:count])
    _, positions, ctx = runner.decode_inputs(b, p)
    assert positions[:5].tolist() == [n - 1 for n in ctx_lens]
    q, k, v = torch.randn(1, H, b, D), torch.randn(1, KVH, b, D), torch.randn(1, KVH, b, D)
    layer = Layer(0)
    before = [cached_kv(cache, 0, pages[i], n - 1) for i, n in enumerate(ctx_lens)]
    out, _ = paged_attention_forward(layer, q, k, v, None, scaling=D ** -0.5,
                                     sliding_window=window, **{CONTEXT_KWARG: ctx})
    for i, n in enumerate(ctx_lens):
        k_all = torch.cat([before[i][0], k[:, :, i:i + 1]], dim=2)
        v_all = torch.cat([before[i][1], v[:, :, i:i + 1]], dim=2)
        want = reference(layer, q[:, :, i:i + 1], k_all, v_all, torch.tensor([n - 1]), window)
        torch.testing.assert_close(out[0, i:i + 1], want, rtol=1e-5, atol=1e-5)


def test_padded_decode_rows_touch_only_the_scratch_page():
    cap, cache, runner, pages = setup(2, [5])
    snapshot = cache.data[:, :, :PAGES].clone()
    rows = (StepRow(seq_id=0, row_slot=0, tokens=(), position=4, pages=pages[0]),)
    staging = np.zeros(staging_size(cap), dtype=np.int64)
    count = runner.pack_decode(StepPlan(0, StepKind.DECODE, rows), staging, 4, 2)
    runner.decode_meta[:count] = torch.from_numpy(staging[:count])
    *_, ctx = runner.decode_inputs(4, 2)
    q, k, v = torch.randn(1, H, 4, D), torch.randn(1, KVH, 4, D), torch.randn(1, KVH, 4, D)
    paged_attention_forward(Layer(0), q, k, v, None, **{CONTEXT_KWARG: ctx})
    changed = (cache.data[:, :, :PAGES] != snapshot).any(dim=(0, 1, 3, 4, 5)).nonzero().flatten()
    assert changed.tolist() == [pages[0][1]]  # only the real row's page holding position 4


def test_prefill_row_groups_bound_the_gather():
    """A small key budget splits rows into groups; results do not change."""
    lens = [9, 2, 14, 5]
    cap, cache, runner, pages = setup(3, lens)
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(1,) * n, position=0, pages=pages[i])
                 for i, n in enumerate(lens))
    staging = np.zeros(staging_size(cap), dtype=np.int64)
    count, shape = runner.pack_prefill(StepPlan(0, StepKind.PREFILL, rows), staging)
    meta = torch.from_numpy(staging[:count])
    q, k, v = torch.randn(1, H, 30, D), torch.randn(1, KVH, 30, D), torch.randn(1, KVH, 30, D)
    outs = []
    for budget in (10_000, 16):
        runner.key_budget = budget
        *_, ctx = runner.prefill_inputs(meta, shape)
        outs.append(paged_attention_forward(Layer(0), q, k, v, None, **{CONTEXT_KWARG: ctx})[0])
        assert len(ctx.row_groups) == (1 if budget > 1000 else 4)
    torch.testing.assert_close(outs[0], outs[1])


def test_attention_without_context_is_a_clear_error():
    q = torch.randn(1, H, 2, D)
    with pytest.raises(RuntimeError, match="PagedContext"):
        paged_attention_forward(Layer(0), q, q[:, :KVH], q[:, :KVH], None)
