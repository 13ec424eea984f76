"""Prefill as rows of one token, so it can be captured in CUDA graphs.

transformers' prefill (runner.prefill_forward) pads each row to the longest
prompt and attends with SDPA: shapes that change every step, run eagerly.
Launching ~20 small kernels per layer from Python then bounds a short
prompt's prefill by the host, not the GPU (the benchmark's *point* workload:
6-8 ms per step, most of it launch).

Here every prompt token is a row of its own, exactly as in a decode step:
token ``t`` of sequence ``r`` attends to ``r``'s pages up to its own
position, through the same paged kernel and the same fused decoder. The
step's new keys and values are written before attention (per layer), so a
token sees the prompt tokens before it. Shapes are then only (tokens T,
sequences R); both are padded to buckets and each (T, R) pair is a graph.

Cost: each token reads its row's keys once (no reuse across a row's
queries), so this path is for short prompts: ``fits`` caps the summed
context over a step's tokens; longer prefills take the eager path.

Static metadata, each part at a fixed offset (see runner.py for why):
``[tokens Tmax | positions Tmax | row_of Tmax | last Rmax |
row_table (Rmax + 1) * max_pages]``. Row ``R`` of a bucket's table is all
scratch pages: padded tokens (position 0) point at it, so they write and
read only the scratch page. Padded sequences read token 0's logits, which
no one samples.
"""

from __future__ import annotations

import numpy as np
import torch

from bubblefree.core.values import StepPlan
from bubblefree.cuda_backend.attention import decode_context
from bubblefree.cuda_backend.graphs import GraphSet, batch_buckets, bucket, page_buckets
from bubblefree.cuda_backend.kernel_config import Dispatch
from bubblefree.cuda_backend.kv_cache import PagedKVCache

# Summed (position + 1) over a step's tokens: keys read per head and layer.
# 64K is 1,024 tokens of 64-token prompts; beyond it SDPA's reuse wins.
DEFAULT_KEY_BUDGET = 1 << 16


def token_buckets(max_tokens: int, smallest: int = 16, fine_from: int | None = None) -> list[int]:
    """Powers of two from ``smallest`` up to ``max_tokens`` (and it); with
    ``fine_from``, also 1.5 times each power of two from there up. Padding
    is GEMM work: an image row of moondream2 (730 prefix positions and its
    prompt) fills 768 to ~96%, where 1,024 would pad it by ~38%."""
    sizes = set(page_buckets(max_tokens, min(smallest, max_tokens)))
    if fine_from is not None:
        sizes.update(p * 3 // 2 for p in list(sizes) if p * 3 // 2 >= fine_from and p * 3 // 2 < max_tokens)
    return sorted(sizes)


class TokenPrefill:
    def __init__(self, decoder, cache: PagedKVCache, max_tokens: int, max_rows: int,
                 max_pages: int, device: torch.device, dispatch: Dispatch,
                 key_budget: int = DEFAULT_KEY_BUDGET):
        self.decoder, self.cache, self.dispatch = decoder, cache, dispatch
        self.max_tokens, self.max_rows, self.max_pages = max_tokens, max_rows, max_pages
        self.key_budget = key_budget
        self.tokens = token_buckets(max_tokens)
        self.rows = batch_buckets(max_rows)
        self.meta = torch.zeros(self.size, dtype=torch.long, device=device)

    @property
    def size(self) -> int:
        """int64 elements of the metadata (static buffer and staging alike)."""
        return 3 * self.max_tokens + self.max_rows + (self.max_rows + 1) * self.max_pages

    def keys(self) -> list[tuple[int, int]]:
        """Every (T, R) bucket a graph is captured for (a row has >= 1 token)."""
        return [(t, r) for t in self.tokens for r in self.rows if r <= t]

    def fits(self, plan: StepPlan) -> bool:
        total = sum(len(r.tokens) for r in plan.rows)
        keys = sum(len(r.tokens) * r.position + len(r.tokens) * (len(r.tokens) + 1) // 2
                   for r in plan.rows)
        return total <= self.max_tokens and len(plan.rows) <= self.max_rows \
            and keys <= self.key_budget

    def views(self, meta, t: int, r: int):
        """tokens ``[t]``, positions ``[t]``, row_of ``[t]``, last ``[r]``,
        row table ``[r + 1, max_pages]`` of ``meta`` (device or staging)."""
        tm, rm = self.max_tokens, self.max_rows
        base = 3 * tm + rm
        return (meta[:t], meta[tm:tm + t], meta[2 * tm:2 * tm + t], meta[3 * tm:3 * tm + r],
                meta[base:base + (r + 1) * self.max_pages].reshape(r + 1, self.max_pages))

    def harmless(self, meta, t: int, r: int) -> None:
        """Every token padded, every sequence padded (for capture)."""
        tokens, positions, row_of, last, table = self.views(meta, t, r)
        tokens[:] = 0
        positions[:] = 0
        row_of[:] = r
        last[:] = 0
        table[:] = self.cache.scratch_page

    def pack(self, plan: StepPlan, staging: np.ndarray, t: int, r: int) -> int:
        """Bucket (t, r)'s metadata for ``plan`` into ``staging``; returns the
        element count to copy. The positions are computed for all rows at
        once: with an ``arange`` a row, 64 rows of 32 tokens (a closed loop
        of short requests) took 124 us of host time a step on the
        development machine, 97 without (one row: 5.0 and 7.5; the column
        of ``bench.bookkeeping``), host time the device waits for at 64
        streams."""
        self.harmless(staging, t, r)
        tokens, positions, row_of, last, table = self.views(staging, t, r)
        lens, shift, at = [], [], 0
        for i, row in enumerate(plan.rows):
            k = len(row.tokens)
            tokens[at:at + k] = row.tokens
            row_of[at:at + k] = i
            last[i] = at + k - 1
            pages = row.pages[:self.max_pages]
            table[i, :len(pages)] = pages
            lens.append(k)
            shift.append(row.position - at)  # a token's position less its index
            at += k
        positions[:at] = np.arange(at) + np.repeat(shift, lens)
        return 3 * self.max_tokens + self.max_rows + (r + 1) * self.max_pages

    def forward(self, t: int, r: int) -> torch.Tensor:
        """Logits ``[r, V]`` of each sequence's last prompt token."""
        tokens, positions, row_of, last, table = self.views(self.meta, t, r)
        page_table = table.index_select(0, row_of)  # [t, max_pages]: each token's row
        ctx = decode_context(self.cache, positions, page_table, self.dispatch)
        return self.decoder(tokens, positions, ctx, last)

    def launch(self, plan: StepPlan, staging_np: np.ndarray, staging: torch.Tensor,
               graphs: GraphSet) -> tuple[torch.Tensor, int]:
        """Enqueue ``plan`` on the current stream: its metadata (one
        non-blocking copy from the slot's pinned ``staging``) and the graph
        of its bucket. Returns the logits ``[b, V]`` and the row bucket b."""
        t = bucket(sum(len(r.tokens) for r in plan.rows), self.tokens)
        b = bucket(len(plan.rows), self.rows)
        k = self.pack(plan, staging_np, t, b)
        self.meta[:k].copy_(staging[:k], non_blocking=True)
        return graphs.run((t, b), lambda: self.forward(t, b)), b

    def capture(self, graphs: GraphSet) -> None:
        """A graph per bucket, largest first (smaller ones reuse its memory)."""
        def items():
            for t, b in reversed(self.keys()):
                yield (t, b), (lambda t=t, b=b: self.harmless(self.meta, t, b)), (
                    lambda t=t, b=b: self.forward(t, b))
        graphs.capture_all(items())
