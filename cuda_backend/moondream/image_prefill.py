"""The launch side of an IMAGE_PREFILL step, on the decode thread.

A row's image is in one of three states, and its row is packed by it:

- crops only (a ``PreparedImage``, or an ``EncodedImage`` not encoded yet):
  the crops of all such images of the step (an image shared by rows, once)
  are copied from pinned memory into one device batch and go through the
  vision encoder in one call; the row's inputs are ``[BOS, 729 features,
  prompt]`` from its first position, the 730 prefix positions attending
  both ways;
- an ``EncodedImage`` whose prefix KV is kept: the KV is written into the
  row's first 730 positions' pages (one copy), and the row's inputs are its
  prompt alone, causal after the prefix.

An ``EncodedImage`` encoded by a step keeps, once that step's forward is
enqueued, the prefix KV its first row wrote (the prefix attends only
within itself, so its KV does not depend on the prompt): later requests
skip the encoder and the prefix's 730 positions. Everything is enqueued on
the current (compute) stream, in order, without a host sync.

With the backend's prefill graphs (the default), the encoder runs as a
graph per chunk of crops (``encoder_graphs``) and the packed prefill as a
graph per token and row bucket (``prefill_graphs``) where the step's rows
fit one; otherwise, or with ``prefill_graphs=False``, both run eagerly.

``ImageWork`` lists what a step encoded, for the slot to settle at release:
a completed step drops the images' crops; a failed one forgets what it
meant to compute (the image is encoded again when next used).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from bubblefree.core.values import StepPlan
from bubblefree.cuda_backend.moondream import prompt_values
from bubblefree.cuda_backend.moondream.prepared import EncodedImage, PreparedImage


@attrs.define
class ImageWork:
    """What an image prefill left to settle when its slot is released."""

    keep: list = attrs.Factory(list)  # host crops a copy may still read (I4)
    encoded: list = attrs.Factory(list)  # EncodedImages this step encoded

    def settle(self, failed: bool) -> None:
        for image in self.encoded:
            if failed:
                image.features = image.kv = None
            else:
                image.prepared = None
        self.encoded.clear()
        self.keep.clear()


def refusal(source: object, length: int, prefix_len: int, backend: object) -> str | None:
    """Why a row's image cannot be prefilled by ``backend``, or None."""
    if length != prefix_len:
        return f"image length {length}, this model's prefix is {prefix_len}"
    if isinstance(source, EncodedImage):
        if not source.made_by(backend):
            return "an EncodedImage made by another backend"
        if not source.encoded and source.prepared is None:
            return "an EncodedImage with neither features, KV nor crops"
        return None
    if not isinstance(source, PreparedImage):
        return f"an image source this backend did not make ({type(source).__name__})"
    return None


def launch(backend, plan: StepPlan, s, work: ImageWork) -> tuple[torch.Tensor, torch.Tensor]:
    """Enqueue ``plan``'s image prefill into slot ``s``; returns the rows'
    logits ``[R, V]`` and hidden states ``[R, D]``."""
    runner, n = backend._runner, backend.prefix_len
    sources = [r.image.source for r in plan.rows]
    kept = [isinstance(src, EncodedImage) and src.kv is not None for src in sources]
    fresh = [i for i, k in enumerate(kept) if not k]
    cached = [i for i, k in enumerate(kept) if k]
    head = np.zeros(n, dtype=np.int64)  # BOS, then placeholders for the features
    head[0] = backend.config.tokenizer.bos_id
    inputs = [np.asarray(r.tokens, dtype=np.int64) if k
              else np.concatenate((head, np.asarray(r.tokens, dtype=np.int64)))
              for r, k in zip(plan.rows, kept)]
    starts = np.array([r.position + (n if k else 0) for r, k in zip(plan.rows, kept)])
    prefix = np.array([0 if k else n for k in kept])
    values = prompt_values.locate(plan.rows, inputs, [0 if k else n for k in kept])
    features = encode(backend, [sources[i] for i in fresh], work) if fresh else None
    graphs = backend._prefill
    key = graphs.key(inputs, starts, len(values)) if graphs is not None else None
    if key is not None:  # static shapes: a graph replay (prefill_graphs)
        logits, hidden = graphs.launch(s.index, key, [r.pages for r in plan.rows], inputs,
                                       starts, prefix, fresh, features,
                                       [(i, sources[i].kv) for i in cached], values)
        for image in work.encoded:  # keep the prefix KV its first row wrote
            j = next(i for i in fresh if sources[i] is image)
            image.kv = backend.cache.gather(graphs.slots(key, j, int(starts[j]), n))
            image.features = None
        return logits[:len(plan.rows)], hidden[:len(plan.rows)]
    k, shape = runner.pack_prefill(plan, s.staging_np, inputs, prefix, starts)
    s.staging_np[k:k + len(plan.rows)] = fresh + cached  # the rows by kind, for the device
    meta = s.staging[:k + len(plan.rows)].to(backend.device, non_blocking=True)
    order = meta[k:k + len(plan.rows)]
    logits, hidden = runner.prefill(meta, shape, features, order[:len(fresh)],
                                    [(order[len(fresh) + j], sources[i].kv)
                                     for j, i in enumerate(cached)],
                                    values=backend.values_input(s, values))
    for image in work.encoded:  # keep the prefix KV its first row wrote
        j = next(j for j, i in enumerate(fresh) if sources[i] is image)
        image.kv = backend.cache.gather(runner.row_slots(meta, shape, order[j], 0, n))
        image.features = None
    return logits, hidden


def encode(backend, sources: list, work: ImageWork) -> torch.Tensor:
    """The features ``[len(sources) * 729, D]`` of rows whose images are
    not kept as KV, in order: what has no features yet goes through the
    encoder, all crops in one call."""
    todo, seen = [], set()
    for src in sources:
        if id(src) not in seen and not (isinstance(src, EncodedImage) and src.encoded):
            seen.add(id(src))
            todo.append(src)
    fresh = {}
    if todo:
        prepared = [src.prepared if isinstance(src, EncodedImage) else src for src in todo]
        work.keep.extend(p.crops for p in prepared)  # pinned host -> device, in stream order
        tilings = [p.tiling for p in prepared]
        if backend._encoder is not None:  # a graph replay per chunk of crops
            embeds = backend._encoder.embed([p.crops for p in prepared], tilings)
        else:
            size = backend.config.vision.crop_size
            crops = torch.empty((sum(p.n_crops for p in prepared), size, size, 3),
                                dtype=torch.uint8, device=backend.device)
            at = 0
            for p in prepared:
                crops[at:at + p.n_crops].copy_(p.crops, non_blocking=True)
                at += p.n_crops
            embeds = backend.vision.embed(crops, tilings)  # [k, 729, D]
        for src, e in zip(todo, embeds):
            fresh[id(src)] = e
            if isinstance(src, EncodedImage):
                src.features = e
                work.encoded.append(src)
    return torch.cat([fresh[id(s)] if id(s) in fresh else s.features for s in sources])
