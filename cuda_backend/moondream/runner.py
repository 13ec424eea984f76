"""moondream2's forwards over the paged cache: the fused Phi decode step with
a value's encoding as a row's input, and the image prefill.

Per row slot, on the device: ``value_flag`` and ``value_emb``. The finalize
phase of a step whose row asked a value sets the row's flag and writes the
value's encoding there (``RegionHead``); any other sampling of the row
clears the flag. A decode step's input for a row is then
``value_emb[row]`` where the flag is set, else the embedding of
``last_token[row]``: chosen inside the captured graph (``step_inputs``), so the
next forward never waits for the host (contract: a value row's NEXT decode
input is its encoding).

Every forward also keeps each row's last hidden state before the final norm
(what the region decoders read): ``hidden`` for decode steps (a static
buffer the graphs write), returned by ``prefill`` for prefills.

A prefill (text or image) packs its rows as ``ModelRunner.pack_prefill``
does, with input ids in which an image row's prefix is BOS and then
placeholders; the image features replace the placeholders' embeddings
before the first layer, and positions below each row's ``prefix_end``
attend both ways (``attention.PagedContext.prefix_end``).
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.attention import decode_context
from bubblefree.cuda_backend.errors import UnsupportedModel
from bubblefree.cuda_backend.runner import ModelRunner


class MoondreamRunner(ModelRunner):
    def __init__(self, model: torch.nn.Module, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        if self.not_fused is not None:
            raise UnsupportedModel(f"moondream's text decoder runs only on the fused Phi step: "
                                   f"{self.not_fused}")
        weight = model.get_input_embeddings().weight
        dim, dtype = weight.shape[1], weight.dtype
        rows, seqs = self.cap.max_rows, self.cap.max_seqs
        self.value_emb = torch.zeros(seqs + 1, dim, dtype=dtype, device=self.device)  # [S+1, D]
        self.value_flag = torch.zeros(seqs + 1, dtype=torch.bool, device=self.device)  # [S+1]
        self.hidden = torch.zeros(rows, dim, dtype=dtype, device=self.device)  # [max_rows, D]

    def decode_forward(self, b: int, p: int) -> torch.Tensor:
        """The decode step at bucket (b, p): logits ``[b, V]``; the rows'
        hidden states land in ``hidden[:b]``."""
        if self.rope is not None:
            x, positions, ctx, rope = self.gathered_inputs(b, p, self.value_flag, self.value_emb)
        else:
            row_slots, positions, page_table = self.meta_views(self.decode_meta, b, p)
            ids = self.last_token.index_select(0, row_slots)  # [b]
            flag = self.value_flag.index_select(0, row_slots).unsqueeze(1)  # [b, 1]
            x = torch.where(flag, self.value_emb.index_select(0, row_slots),
                            self.decoder.embed(ids))  # [b, D]
            ctx = decode_context(self.cache, positions, page_table, self.kernels.dispatch)
            rope = None
        h, logits = self.decoder.decode_step(x, positions, ctx, rope)
        self.hidden[:b].copy_(h)
        return logits

    def prefill(self, meta: torch.Tensor, shape: tuple[int, ...],
                features: torch.Tensor | None = None, feature_rows: torch.Tensor | None = None,
                cached: list = (), values=None) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed prefill from ``pack_prefill``'s metadata on the device.
        ``features`` ``[F * n, D]`` replace input positions ``1 .. n`` of
        the rows ``feature_rows`` ``[F]`` (an image's BOS then its features);
        ``cached`` pairs (row ``[]``, prefix KV ``[L, 2, m, KVH, D]``) write a
        kept image prefix at the ``m`` positions before such a row's first
        input; ``values`` (``x -> x``) writes the prompt values' inputs over
        the embeddings (``prompt_values.overwrite``). Returns the logits
        ``[R, V]`` and the hidden states ``[R, D]`` of each row's last input."""
        tokens, positions, last, ctx = self.prefill_inputs(meta, shape)
        for row, kv in cached:
            self.cache.scatter(self.row_slots(meta, shape, row, -kv.shape[2], kv.shape[2]), kv)
        x = self.decoder.embed(tokens[0])  # [T, D]
        if features is not None:
            t, rows = shape[:2]
            q_start = meta[4 * t:4 * t + rows].index_select(0, feature_rows)  # [F]
            per_row = features.shape[0] // feature_rows.shape[0]
            offsets = torch.arange(1, 1 + per_row, device=meta.device)
            index = (q_start.unsqueeze(1) + offsets).view(-1)  # [F * n]
            x = x.index_copy(0, index, features.to(x.dtype))
        if values is not None:
            x = values(x)
        # Uncompiled: a prefill's shapes change every step.
        h = self.decoder.hidden(x, positions[0], ctx, compiled=False).index_select(0, last)
        return self.decoder.head(h), h

    def row_slots(self, meta: torch.Tensor, shape: tuple[int, ...], row: torch.Tensor,
                  offset: int, n: int) -> torch.Tensor:
        """Flat KV slots ``[n]`` of positions ``pos0 + offset ..`` of packed
        row ``row`` (a 0-d device index): through its page table, on the device."""
        t, rows, _, p = shape[:4]
        ps = self.cap.page_size
        row = row.view(1)
        pos0 = meta[4 * t + 2 * rows:4 * t + 3 * rows].index_select(0, row)  # [1]
        table = meta[4 * t + 4 * rows:4 * t + 4 * rows + rows * p].view(rows, p)
        pos = pos0 + offset + torch.arange(n, device=meta.device)  # [n]
        return table.index_select(0, row)[0].index_select(0, pos // ps) * ps + pos % ps
