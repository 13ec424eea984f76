"""moondream's packed prefill (image prefix and prompt, or a prompt alone)
as CUDA graphs per (token bucket T, row bucket R).

Eager, the packed prefill is ~25 kernels per layer, 600 for moondream2's
24 layers, each paying PyTorch's host dispatch. Captured, a step costs
its metadata copy and one replay.

Static shapes. Tokens are packed as ``ModelRunner.pack_prefill`` packs
them and padded to T (``token_buckets``, 1.5× steps from one image row
up); rows are padded to R
(``batch_buckets`` of the most rows an image prefill can have); every row
reads P pages, P the page bucket of the shortest image row (BOS, 729
features and one token: 64 pages of 16 for moondream2), so P is fixed and
a step whose rows need more pages runs eagerly. Attention pads each row's
queries to S = min(T, P * page_size): no row is longer than its pages.

Static metadata, each part at a fixed offset whatever the bucket (as in
``runner.py``): ``[tokens Tm | positions Tm | slot Tm | out_gather Tm |
feature Tm | q_start Rm | q_len Rm | pos0 Rm | last Rm | prefix_end Rm |
pages Rm * P]``; ``feature`` is each token's row in the static feature
buffer, or -1. The image features replace their tokens' embeddings by a
``torch.where`` (fixed shape), not an ``index_copy`` of a per-step count.

Padding writes only the scratch page (I6): a padded token is token 0 at
position 0 whose KV slot is the scratch page's first; a padded row has no
queries and a page table of scratch pages. Neither changes a real row: a
layer mixes tokens only in attention, which reads keys from each row's
own pages, and padded tokens' outputs are dropped (``out_gather`` points
them at query 0, whose values are finite). Real rows' tables are padded
with the scratch page too; its keys lie past every query's position
(causal mask) and outside every prefix.

Prompt values (spatial references, ``prompt_values``) ride in a static
buffer of ``GRAPH_VALUES`` entries staged beside the metadata: the graph
encodes them all and writes them over their positions' embeddings,
padding entries aiming nowhere; a step with more runs eagerly.

Outside the graph, in stream order around the replay: the metadata copy
(pinned host staging, one per slot, I4), the features' copy into the
static buffer, a kept image's KV copied into its row's pages (its tensor
is the image's own, not static) and, after, the KV a newly encoded image's
row wrote, kept for later requests (``image_prefill``).
"""

from __future__ import annotations

import numpy as np
import torch

from bubblefree.cuda_backend.attention import prefill_context
from bubblefree.cuda_backend.graphs import GraphSet, batch_buckets, bucket
from bubblefree.cuda_backend.moondream import prompt_values
from bubblefree.cuda_backend.moondream.prompt_values import GRAPH_VALUES
from bubblefree.cuda_backend.token_prefill import token_buckets


class PrefillGraphs:
    def __init__(self, runner, *, prefix_len: int, rows: int, pages: int, graphs: GraphSet,
                 region=None):
        """``rows``: the most rows a graph takes; ``pages``: P; ``region``:
        the region module that encodes prompt values (None: no values)."""
        cap = runner.cap
        self.runner, self.cache, self.graphs, self.region = runner, runner.cache, graphs, region
        self.prefix_len, self.ps, self.pages = prefix_len, cap.page_size, pages
        # Finer from one image row up: rows of ~740 tokens fill 768, 1,536, 3,072.
        self.tokens = token_buckets(cap.max_prefill_tokens, fine_from=prefix_len)
        self.rows = batch_buckets(rows)
        self.tm, self.rm = self.tokens[-1], self.rows[-1]
        self.size = 5 * self.tm + 5 * self.rm + self.rm * pages
        self.values_at = self.size  # prompt_values.stage's layout, GRAPH_VALUES entries
        self.size += 4 * GRAPH_VALUES
        device = runner.device
        pin = device.type == "cuda"
        self.meta = torch.zeros(self.size, dtype=torch.long, device=device)
        # One staging per DecodeSlot: reused only after its step's release (I4).
        self.staging = [torch.zeros(self.size, dtype=torch.long, pin_memory=pin) for _ in (0, 1)]
        weight = runner.decoder.embed.weight
        # [Rm * 729, D]: the step's fresh image features, in fresh-row order
        self.features = torch.zeros(self.rm * (prefix_len - 1), weight.shape[1],
                                    dtype=weight.dtype, device=device)

    @classmethod
    def make(cls, runner, prefix_len: int, page_sizes: list[int], graphs: GraphSet, region=None):
        """For ``runner``'s capacity, or None where no image row fits a graph."""
        cap = runner.cap
        rows = min(cap.max_rows, cap.max_prefill_tokens // (prefix_len + 1))
        need = -(-(prefix_len + 1) // cap.page_size)
        if rows < 1 or need > page_sizes[-1]:
            return None
        return cls(runner, prefix_len=prefix_len, rows=rows, pages=bucket(need, page_sizes),
                   graphs=graphs, region=region)

    def keys(self) -> list[tuple[int, int]]:
        """Every (T, R) captured (a row has at least one token)."""
        return [(t, r) for t in self.tokens for r in self.rows if r <= t]

    def key(self, inputs: list, starts: np.ndarray, n_values: int = 0) -> tuple[int, int] | None:
        """The bucket of rows with ``inputs`` (id arrays) from ``starts``
        and ``n_values`` prompt values, or None when they do not fit one
        (too many rows, pages or values)."""
        total = sum(len(x) for x in inputs)
        end = max(int(s) + len(x) for s, x in zip(starts, inputs))
        if len(inputs) > self.rm or total > self.tm or end > self.pages * self.ps:
            return None
        if n_values and (self.region is None or n_values > GRAPH_VALUES):
            return None
        return bucket(total, self.tokens), bucket(len(inputs), self.rows)

    def views(self, meta, t: int, r: int):
        """The bucket's parts of ``meta`` (device buffer or staging array):
        five of ``[t]``, five of ``[r]``, the page table ``[r, P]``."""
        tm, rm = self.tm, self.rm
        per_token = [meta[i * tm:i * tm + t] for i in range(5)]
        per_row = [meta[5 * tm + i * rm:5 * tm + i * rm + r] for i in range(5)]
        base = 5 * tm + 5 * rm
        return (*per_token, *per_row, meta[base:base + r * self.pages].reshape(r, self.pages))

    def harmless(self, meta, t: int, r: int) -> None:
        """Every token and row of bucket (t, r) padded."""
        tokens, positions, slot, out_gather, feature, *per_row, table = self.views(meta, t, r)
        for part in (tokens, positions, out_gather, *per_row):
            part[:] = 0
        slot[:] = self.cache.scratch_page * self.ps
        feature[:] = -1
        table[:] = self.cache.scratch_page
        values = meta[self.values_at:self.values_at + 4 * GRAPH_VALUES]  # no prompt value
        values[:] = 0
        values[:GRAPH_VALUES] = -1

    def pack(self, staging: np.ndarray, key: tuple[int, int], pages: list, inputs: list,
             starts: np.ndarray, prefix: np.ndarray, fresh: list[int], values: list = ()) -> int:
        """Bucket ``key``'s metadata into ``staging``: row i's ids
        ``inputs[i]`` at positions ``starts[i] ..`` in its ``pages[i]``, its
        first ``prefix[i]`` positions attending both ways; the rows
        ``fresh`` take features 0, 1, .. at their inputs 1 .. 729; the
        prompt ``values`` (``prompt_values.locate``'s) after it all. Returns
        the element count to copy (all of the buffer: the values sit at its end)."""
        t, r = key
        ps, s_len = self.ps, min(t, self.pages * self.ps)
        self.harmless(staging, t, r)
        (tokens, positions, slot, out_gather, feature, q_start, q_len, pos0, last, prefix_end,
         table) = self.views(staging, t, r)
        n_feat = self.prefix_len - 1
        at = 0
        for i, ids in enumerate(inputs):
            n, start = len(ids), int(starts[i])
            own = pages[i][:self.pages]
            table[i, :len(own)] = own
            pos = np.arange(start, start + n)
            tokens[at:at + n] = ids
            positions[at:at + n] = pos
            slot[at:at + n] = table[i, pos // ps] * ps + pos % ps
            out_gather[at:at + n] = i * s_len + np.arange(n)
            q_start[i], q_len[i], pos0[i], last[i] = at, n, start, at + n - 1
            prefix_end[i] = start + int(prefix[i])
            if i in fresh:
                f = fresh.index(i)
                feature[at + 1:at + 1 + n_feat] = np.arange(f * n_feat, (f + 1) * n_feat)
            at += n
        prompt_values.stage(staging[self.values_at:], list(values), GRAPH_VALUES)
        return self.size

    def forward(self, t: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the graph for (t, r) records: logits ``[r, V]`` and hidden
        states ``[r, D]`` of each row's last input."""
        (tokens, positions, slot, out_gather, feature, q_start, q_len, pos0, last, prefix_end,
         table) = self.views(self.meta, t, r)
        dec = self.runner.decoder
        ctx = prefill_context(self.cache, slot, table, q_start, q_len, pos0, out_gather,
                              min(t, self.pages * self.ps), self.runner.key_budget, prefix_end)
        x = dec.embed(tokens)  # [t, D]
        feats = self.features.index_select(0, feature.clamp(min=0))  # [t, D]
        x = torch.where((feature >= 0).unsqueeze(1), feats, x)
        if self.region is not None:
            x = prompt_values.overwrite(x, self.region, self.meta[self.values_at:], GRAPH_VALUES)
        h = dec.hidden(x, positions, ctx, compiled=False).index_select(0, last)  # [r, D]
        return dec.head(h), h

    def launch(self, slot: int, key: tuple[int, int], pages: list, inputs: list,
               starts: np.ndarray, prefix: np.ndarray, fresh: list[int],
               features: torch.Tensor | None, kept: list, values: list = ()
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Enqueue a prefill on the current stream: metadata, features, the
        kept prefixes' KV (``kept``: pairs of row and ``[L, 2, m, KVH, D]``,
        written at the m positions before the row's first input), the
        replay. Returns the bucket's logits ``[R, V]`` and hidden ``[R, D]``
        (graph outputs: consume them before the next replay)."""
        staging = self.staging[slot]
        k = self.pack(staging.numpy(), key, pages, inputs, starts, prefix, fresh, values)
        self.meta[:k].copy_(staging[:k], non_blocking=True)
        if features is not None:
            self.features[:features.shape[0]].copy_(features)
        for row, kv in kept:
            m = kv.shape[2]
            self.cache.scatter(self.slots(key, row, int(starts[row]) - m, m), kv)
        t, r = key
        return self.graphs.run(key, lambda: self.forward(t, r))

    def slots(self, key: tuple[int, int], row: int, start: int, n: int) -> torch.Tensor:
        """Flat KV slots ``[n]`` of positions ``start ..`` of packed row
        ``row``, through the device page table (after the metadata copy)."""
        table = self.views(self.meta, *key)[-1][row]  # [P]
        pos = torch.arange(start, start + n, device=self.meta.device)
        return table.index_select(0, pos // self.ps) * self.ps + pos % self.ps

    def capture(self) -> None:
        """A graph per key, largest first (smaller ones reuse its memory)."""
        def items():
            for t, r in reversed(self.keys()):
                yield (t, r), (lambda t=t, r=r: self.harmless(self.meta, t, r)), (
                    lambda t=t, r=r: self.forward(t, r))
        self.graphs.capture_all(items())
