"""The VLM backend's IMAGE_PREFILL launch, on the compute stream, no host sync.

Per row: ``[head, the image's block, prompt]``. The images without features
yet go through the tower and projector (one call per shape of input); the
features are written over the placeholders' embeddings, in order. An
encoded image (``keep``) keeps what its first step made on the device:
where the prompt cannot change it (every model but a prefix LM, PaliGemma,
whose image attends to the question) the KV of its whole prefix, so a later
row copies that KV into its pages and prefills its prompt alone; on a
prefix LM its features. With 3-D rotary (``mrope``) the rows' positions come from the
model on the host and each row's delta lands at its row slot.

Host values travel through the slot's pinned buffer (``VlmBackend._where``,
reused only after the slot's release, I4), in this order: placeholders'
packed indices, KV slots, row slots and deltas, rotary positions.
"""

from __future__ import annotations

import numpy as np
import torch

from bubblefree.core.values import StepPlan
from bubblefree.cuda_backend.attention import CONTEXT_KWARG
from bubblefree.cuda_backend.graphs import bucket
from bubblefree.cuda_backend.slots import DecodeSlot
from bubblefree.cuda_backend.vlm.mrope import rope_positions
from bubblefree.cuda_backend.vlm.pixels import VlmPixels


class Staging:
    """The slot's pinned buffer, filled front to back; each part copied to
    the device without a wait."""

    def __init__(self, buffer: torch.Tensor, device: torch.device):
        self.buffer, self.view, self.device, self.at = buffer, buffer.numpy(), device, 0

    def put(self, values: np.ndarray) -> torch.Tensor:
        n = int(values.size)
        self.view[self.at:self.at + n] = values.reshape(-1)
        part = self.buffer[self.at:self.at + n].to(self.device, non_blocking=True)
        self.at += n
        return part


def kv_slots(row, first: int, count: int, page_size: int) -> np.ndarray:
    """Flat KV slots of positions ``first .. first + count - 1`` of ``row``."""
    pos = np.arange(first, first + count)
    return np.asarray(row.pages, dtype=np.int64)[pos // page_size] * page_size + pos % page_size


def launch(be, s: DecodeSlot, plan: StepPlan) -> tuple[torch.Tensor, int]:
    """Enqueue ``plan``'s image prefill into slot ``s`` (``be``: the
    VlmBackend); returns the rows' logits ``[R, V]`` and the row bucket."""
    rows, runner, vl, ps = plan.rows, be._runner, be.vl, be.capacity.page_size
    sources: list[VlmPixels] = [r.image.source for r in rows]
    prompts = [np.asarray(r.tokens, dtype=np.int64) for r in rows]
    full = [np.concatenate((be.head, np.asarray(src.block, dtype=np.int64), p)) for src, p in zip(sources, prompts)]
    prefix = [len(f) - len(p) for f, p in zip(full, prompts)]
    cached = [not vl.prefix_lm and src.kv is not None for src in sources]
    inputs = [p if c else f for p, f, c in zip(prompts, full, cached)]
    starts = np.array([r.position + (m if c else 0) for r, m, c in zip(rows, prefix, cached)], dtype=np.int64)
    k, shape = runner.pack_prefill(plan, s.staging_np, inputs, be._prefix(inputs), starts)
    meta = s.staging[:k].to(be.device, non_blocking=True)
    staging = Staging(be._where[s.index], be.device)
    fresh = [i for i, c in enumerate(cached) if not c]
    q = np.cumsum([0] + [len(x) for x in inputs[:-1]])
    where = np.concatenate([q[i] + len(be.head) + np.flatnonzero(np.asarray(sources[i].block) == vl.image_token_id)
                            for i in fresh]) if fresh else np.zeros(0, dtype=np.int64)
    where = staging.put(where)
    # The prefix's KV slots of the rows that copy a kept prefix in or keep theirs.
    keeps = [c or (not vl.prefix_lm and src.keep) for c, src in zip(cached, sources)]
    slots = {i: staging.put(kv_slots(rows[i], rows[i].position, prefix[i], ps)) for i, k in enumerate(keeps) if k}
    features = be._features(s, [sources[i] for i in fresh]) if fresh else None  # [placeholders, D]
    input_ids, positions, last, ctx = runner.prefill_inputs(meta, shape)
    for i in (i for i, c in enumerate(cached) if c):  # the kept prefix, before the prompt reads it
        be.cache.scatter(slots[i], sources[i].kv)
    if vl.mrope:
        positions = _rope(be, staging, plan, full, sources, [len(x) for x in inputs])
    embeds = vl.text.get_input_embeddings()(input_ids)  # [1, T, D]
    if features is not None:
        embeds[0].index_copy_(0, where, features.to(embeds.dtype))
    out = vl.text(inputs_embeds=embeds, position_ids=positions, use_cache=False, logits_to_keep=last,
                  **{CONTEXT_KWARG: ctx})
    for i in fresh:  # an encoded image keeps its prefix's KV (in stream order, after the forward)
        if keeps[i] and sources[i].kv is None:
            sources[i].kv = be.cache.gather(slots[i])
    return out.logits[0], bucket(len(rows), be._rows)


def _rope(be, staging: Staging, plan: StepPlan, full: list, sources: list, lengths: list[int]) -> torch.Tensor:
    """The rows' 3-D rotary positions ``[3, 1, T]`` on the device (of each
    row's inputs: a row with a kept prefix, its prompt's), and their deltas
    left at their row slots."""
    starts = np.array([r.position for r in plan.rows], dtype=np.int64)
    grids = [src.tensors["image_grid_thw"] for src in sources]
    pos, deltas = rope_positions(be.vl.vlm, full, grids, starts, be.vl.image_token_id)
    set_deltas(be, staging, plan, deltas)
    packed = np.concatenate([p[:, len(f) - n:] for p, f, n in zip(pos, full, lengths)], axis=1)
    return staging.put(packed).view(3, 1, -1)


def set_deltas(be, staging: Staging, plan: StepPlan, deltas: np.ndarray) -> None:
    """The rows' rotary deltas into ``rope_delta`` at their row slots."""
    n = len(plan.rows)
    both = staging.put(np.concatenate((np.array([r.row_slot for r in plan.rows], dtype=np.int64), deltas)))
    be._runner.rope_delta.index_copy_(0, both[:n], both[n:])


def encode(be, sources: list[VlmPixels]) -> list[torch.Tensor]:
    """Each source's features ``[tokens, D]``: one tower call for images
    whose tensors have the same shapes (LLaVA's always do; LLaVA-NeXT's and
    Idefics3's when their grids do; Qwen's patches, rows, concatenate
    whatever their count), copied from pinned memory without a wait; a
    graph replay per chunk where the backend has them (``tower_graphs``)."""
    groups: dict[tuple, list[int]] = {}
    for i, src in enumerate(sources):
        groups.setdefault(() if be.vl.mrope else src.shapes, []).append(i)
    join = torch.cat if be.vl.mrope else torch.stack
    out: list = [None] * len(sources)
    for members in groups.values():
        if be._tower is not None and be._tower.takes(sources[members[0]].tensors):
            for i, features in zip(members, be._tower.features([sources[i].tensors for i in members])):
                out[i] = features
            continue
        batch = {name: join([sources[i].tensors[name].to(be.device, non_blocking=True) for i in members])
                 for name in sources[members[0]].tensors}
        batch["pixel_values"] = batch["pixel_values"].to(be.dtype)
        for i, features in zip(members, be.vl.image_features(**batch)):
            out[i] = features
    return out
