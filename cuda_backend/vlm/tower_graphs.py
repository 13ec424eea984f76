"""A transformers VLM's vision tower and projector as CUDA graphs, one per image count.

Eager, a tower is hundreds of kernel launches a call (a 27-layer SigLIP:
some 380), each paying PyTorch's host dispatch on the decode thread, so the
host, not the GPU, sets the pace of an image prefill. Where every image's
input has one shape and the tower's forward has no host-dependent control
flow (``FIXED``: LLaVA, PaliGemma), a step's images are copied into one
static device buffer and the tower over them is one graph replay, as
moondream2's encoder (``moondream/encoder_graphs.py``): a graph for every
count 1 .. C exactly (images do not attend to each other, so padding would
be waste), C the most images a step can hold, at most 16; more run in
chunks of C. Each replay's output is copied out at once: the graphs share
their memory.

The others run eagerly: LLaVA-NeXT's grids follow the image's size,
Idefics3 drops padding tiles by a mask on the host, Qwen's patches are
sequences of the image's length.

The buffer is shared by both slots: copies into it and replays run in
order on the one compute stream (I1). Without CUDA (or with graphs off)
``GraphSet.run`` runs the same function eagerly, so the bucketed path is
what the CPU tests exercise.
"""

from __future__ import annotations

from typing import Any

import torch

from bubblefree.cuda_backend.graphs import GraphSet

FIXED = ("llava", "paligemma")
MAX_GRAPH_IMAGES = 16


class TowerGraphs:
    def __init__(self, vl: Any, shape: tuple[int, ...], max_images: int, graphs: GraphSet,
                 device: torch.device, dtype: torch.dtype):
        """``vl``: the ``VisionLanguage``; ``shape``: one image's
        ``pixel_values``; ``max_images``: the most a step can hold."""
        self.vl, self.graphs, self.shape = vl, graphs, tuple(shape)
        self.chunk = max(1, min(MAX_GRAPH_IMAGES, max_images))
        self.pixels = torch.zeros((self.chunk, *self.shape), dtype=dtype, device=device)

    @classmethod
    def make(cls, vl: Any, tensors: dict[str, torch.Tensor], max_images: int, graphs: GraphSet,
             device: torch.device, dtype: torch.dtype) -> TowerGraphs | None:
        """For a ``FIXED`` model whose processor gave ``tensors`` for an
        image (pixel values alone), else None."""
        if vl.vlm.config.model_type not in FIXED or set(tensors) != {"pixel_values"}:
            return None
        return cls(vl, tensors["pixel_values"].shape, max_images, graphs, device, dtype)

    def takes(self, tensors: dict[str, torch.Tensor]) -> bool:
        return set(tensors) == {"pixel_values"} and tuple(tensors["pixel_values"].shape) == self.shape

    def encode(self, n: int) -> torch.Tensor:
        """What the graph for ``n`` images records: ``[n, tokens, D]``."""
        with torch.no_grad():
            return torch.stack(self.vl.image_features(pixel_values=self.pixels[:n]))

    def features(self, tensors: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's features ``[tokens, D]``, its pixels (pinned on
        CUDA) copied in without a wait; enqueued on the current stream."""
        out: list[torch.Tensor] = []
        for at in range(0, len(tensors), self.chunk):
            part = tensors[at:at + self.chunk]
            for j, t in enumerate(part):
                self.pixels[j].copy_(t["pixel_values"].to(self.pixels.device, non_blocking=True))
            m = len(part)
            out.extend(self.graphs.run(m, lambda m=m: self.encode(m)).clone().unbind(0))
        return out

    def capture(self) -> None:
        """A graph per image count, largest first (smaller ones reuse its
        memory in the shared pool). The static pixels hold zeros: harmless."""
        self.pixels.zero_()
        self.graphs.capture_all((n, (lambda: None), (lambda n=n: self.encode(n)))
                                for n in range(self.chunk, 0, -1))

    def __str__(self) -> str:
        where = "graphs" if self.graphs.enabled else "eager buckets"
        return f"vision tower in {where} by image count, up to {self.chunk} a replay"
