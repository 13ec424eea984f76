"""moondream2 as a backend, from a checkpoint directory or a config.

``build`` is what the user layer calls::

    backend, info = build("/models/moondream2")        # a local checkpoint
    backend, info = build(tiny_config(), seed=0)         # random weights
    ref = backend.image_ref(load_image(path))            # on the caller's thread
    Request(prompt=info.template("query", "prefix") + ids + info.template("query", "suffix"),
            image=ref, stop_ids={info.eos_id}, max_tokens=128)

Nothing is downloaded. Device defaults to CUDA when present, dtype to
bfloat16 there and float32 on the CPU.
"""

from __future__ import annotations

import os

import attrs
import torch

from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.config import MoondreamConfig
from bubblefree.cuda_backend.moondream.model import Moondream
from bubblefree.cuda_backend.moondream.weights import MoondreamCheckpoint, load_checkpoint, random_model


@attrs.frozen
class MoondreamInfo:
    """What a caller needs beside the backend to frame prompts and read answers."""

    config: MoondreamConfig
    tokenizer: object | None  # a ``tokenizers.Tokenizer`` where the checkpoint has one

    @property
    def bos_id(self) -> int:
        return self.config.tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self.config.tokenizer.eos_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.eos_id})

    @property
    def image_length(self) -> int:
        """KV positions an image takes (``ImageRef.length``): BOS and 729."""
        return self.config.text.prefix_attn

    def template(self, skill: str, part: str) -> tuple[int, ...]:
        return self.config.tokenizer.template(skill, part)


def build(source: str | os.PathLike | MoondreamCheckpoint | MoondreamConfig | Moondream, *,
          device: str | torch.device | None = None, dtype: torch.dtype | None = None,
          seed: int = 0, **options) -> tuple[MoondreamBackend, MoondreamInfo]:
    """A ``MoondreamBackend`` and its ``MoondreamInfo`` from a local checkpoint
    directory, or one ``weights.open_checkpoint`` has checked
    (``weights.load_checkpoint``), a ``MoondreamConfig`` (random weights
    from ``seed``) or a ``Moondream`` module (used as it is).
    ``options`` are ``CudaBackend``'s (page_size, max_rows, use_graphs, ...)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = None
    if isinstance(source, Moondream):
        model = source
    elif isinstance(source, MoondreamConfig):
        model = random_model(source, seed=seed, dtype=dtype, device=device)
    else:
        loaded = load_checkpoint(source, dtype=dtype, device=device)
        model, tokenizer = loaded.model, loaded.tokenizer
    backend = MoondreamBackend(model, **options)
    if not isinstance(source, Moondream):
        # The backend holds the text weights itself (fused); ours would be a
        # second copy of most of them.
        model.text = None
    return backend, MoondreamInfo(config=model.config, tokenizer=tokenizer)
