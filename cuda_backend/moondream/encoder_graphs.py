"""The vision encoder of an image prefill as CUDA graphs, one per crop count.

Eager, a 27-layer encoder is some 380 kernel launches per call, each paying
PyTorch's host dispatch: the decode thread, not the GPU, set the pace of an
image prefill. Here the crops of a step are copied (pinned host -> one
static device buffer ``crops`` ``[C, 378, 378, 3]`` uint8, non-blocking, in
stream order) and the encoder over them (normalization, patch embedding,
every block, the final norm) is one graph replay.

Buckets are every crop count 1 .. C, exactly: a crop attends only within
itself, so padding would be pure waste (1.5 ms of GPU per crop for
moondream2), and a graph per count costs only warm-up time. C is 16, or
fewer when no step can have that many: 16 crops are already 11,664 tokens
per GEMM, so larger batches gain nothing, and the graphs' memory stays
that of 16 crops. A step with more crops runs its crops in chunks of C,
each chunk's features copied out before the next replay.

What stays eager, after the replays: each image's reconstruction of its
local grid, pooling and the projection (``VisionEncoder.project_images``).
That is about five kernels per image plus one per local crop (a slice
copy), and four per step: 20 for a 12-crop image against the encoder's
380; capturing it would need a graph per combination of tilings in a step.

Without CUDA (or with graphs off) ``GraphSet.run`` runs the same function
eagerly, so the chunked path is what the CPU tests exercise.
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.graphs import GraphSet
from bubblefree.cuda_backend.moondream.vision import VisionEncoder, normalize

MAX_GRAPH_CROPS = 16


def crop_buckets(max_step_crops: int) -> list[int]:
    """Crop counts a graph is captured for: 1 .. min(16, ``max_step_crops``)."""
    return list(range(1, max(1, min(MAX_GRAPH_CROPS, max_step_crops)) + 1))


class EncoderGraphs:
    def __init__(self, vision: VisionEncoder, max_step_crops: int, graphs: GraphSet,
                 device: torch.device):
        cfg = vision.config
        self.vision, self.graphs = vision, graphs
        self.buckets = crop_buckets(max_step_crops)
        self.chunk = self.buckets[-1]
        self.dtype = vision.patch_emb.weight.dtype
        # [C, S, S, 3] uint8: every replay's input; both slots share it, safe
        # because copies into it and replays run in order on one stream (I1).
        self.crops = torch.zeros(self.chunk, cfg.crop_size, cfg.crop_size, cfg.in_channels,
                                 dtype=torch.uint8, device=device)

    def encode(self, n: int) -> torch.Tensor:
        """What the graph for ``n`` crops records: features ``[n, 729, dim]``
        of ``crops[:n]``."""
        return self.vision.encode(normalize(self.crops[:n], self.dtype))

    def features(self, host_crops: list[torch.Tensor]) -> torch.Tensor:
        """Each image's host crops ``[n_i, S, S, 3]`` (pinned on CUDA) ->
        encoder features ``[sum n_i, 729, dim]``, enqueued on the current
        stream. A single chunk's result is the graph's own output: the
        caller must consume it before the next replay (stream order does)."""
        total = sum(c.shape[0] for c in host_crops)
        out = None
        done, image, within = 0, 0, 0
        while done < total:
            m = min(self.chunk, total - done)
            filled = 0
            while filled < m:  # this chunk's crops, possibly spanning images
                src = host_crops[image]
                take = min(m - filled, src.shape[0] - within)
                self.crops[filled:filled + take].copy_(src[within:within + take],
                                                       non_blocking=True)
                filled, within = filled + take, within + take
                if within == src.shape[0]:
                    image, within = image + 1, 0
            f = self.graphs.run(m, lambda m=m: self.encode(m))  # [m, 729, dim]
            if done == 0 and m == total:
                return f
            if out is None:
                out = torch.empty((total,) + tuple(f.shape[1:]), dtype=f.dtype, device=f.device)
            out[done:done + m].copy_(f)
            done += m
        return out

    def embed(self, host_crops: list[torch.Tensor], tilings: list[tuple[int, int]]) -> torch.Tensor:
        """Image embeddings ``[k, 729, text dim]``, as ``VisionEncoder.embed``."""
        return self.vision.project_images(self.features(host_crops), tilings)

    def capture(self) -> None:
        """A graph per crop count, largest first (smaller ones reuse its
        memory in the shared pool). The static crops hold zeros: harmless."""
        self.crops.zero_()
        self.graphs.capture_all((n, (lambda: None), (lambda n=n: self.encode(n)))
                                for n in reversed(self.buckets))
