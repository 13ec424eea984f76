"""Images on their way to the device: what the caller's thread makes.

``prepare`` cuts an RGB image into moondream's overlapping crops, in host
memory (pinned when the backend is on CUDA, so the decode thread's copy to
the device never waits). It runs on the caller's thread, at submit: the
decode thread only enqueues copies and the encoder. With a CUDA stream (the
backend's ``crops_on_device``) an image that needs resizing is resized and
cut on the device, on that stream, and its crops come back to pinned memory
before ``prepare`` returns.

An ``EncodedImage`` (moondream's name) is an image meant for several
questions. It starts as crops; the first image prefill that uses it encodes
it (on the decode thread, inside the step's launch) and keeps the KV its
prefix wrote, on the device, so later prefills skip the encoder and the
prefix (``image_prefill``). Only the backend that made it fills or reads
it: the fields below are the decode thread's once the image is handed to
the engine.
"""

from __future__ import annotations

import weakref

import attrs
import numpy as np
import torch
from PIL import Image

from bubblefree.cuda_backend.moondream.config import VisionConfig
from bubblefree.cuda_backend.moondream.image_crops import overlap_crops, overlap_crops_on, plan_crops


@attrs.frozen(eq=False)
class PreparedImage:
    """One image's crops, global view first: ``[n, S, S, 3]`` uint8 on the host."""

    crops: torch.Tensor
    tiling: tuple[int, int]  # (rows, cols) of local crops

    @property
    def n_crops(self) -> int:
        return self.crops.shape[0]


def prepare(image: Image.Image, config: VisionConfig, pin: bool,
            stream: torch.cuda.Stream | None = None) -> PreparedImage:
    """An RGB PIL image -> its crops in host memory (pinned with ``pin``).
    With a CUDA ``stream``, an image to resize is resized and cut there
    (``overlap_crops_on``, the same pixels): Pillow's resizes of a 756-px
    image take about 20 ms of this thread."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    if stream is not None and (image.height, image.width) != (config.crop_size,) * 2 and _fits_on_device(
            image.height, image.width, config):
        try:
            return _prepare_on(image, config, stream)
        except torch.cuda.OutOfMemoryError:  # the device is full: the host can still do it
            pass
    crops, plan = overlap_crops(image, config, pin)  # [n, S, S, 3] uint8
    return PreparedImage(crops=crops, tiling=plan.tiling)


# The device's resizes are dense [out, in] float64 matrices, one per axis
# and view: past this many entries (a GiB) an image of extreme shape (1 x
# 2,000,000 px) is cut on the host, whose resizes take a window a pixel.
MAX_MATRIX_ENTRIES = 1 << 27


def _fits_on_device(height: int, width: int, config: VisionConfig) -> bool:
    size = config.crop_size
    local = plan_crops(height, width, config).resized
    return max(height * max(size, local[0]), width * max(size, local[1])) <= MAX_MATRIX_ENTRIES


def _prepare_on(image: Image.Image, config: VisionConfig, stream: torch.cuda.Stream) -> PreparedImage:
    """The crops made on ``stream``'s device and copied back to pinned host
    memory; this thread waits for its own work only (the event), never for
    the decode thread's steps, and keeps nothing on the device."""
    pixels = torch.from_numpy(np.array(image))  # [H, W, 3] uint8, writable (asarray's is read-only)
    with torch.cuda.stream(stream):
        crops, plan = overlap_crops_on(pixels.to(stream.device), config)
        host = torch.empty(crops.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(crops, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return PreparedImage(crops=host, tiling=plan.tiling)


@attrs.define(eq=False)
class EncodedImage:
    """An image to encode once and ask many questions of.

    ``owner`` is the backend that made it (its device holds the KV), held
    weakly: an image a caller keeps does not keep a backend alive.
    ``prepared`` holds the crops until a step that encoded them has
    completed; ``kv`` ``[layers, 2, 730, kv heads, head dim]`` (device, the
    model's dtype: 140 MB for moondream2 in bfloat16) is set by the decode
    thread when that step is launched; ``features`` ``[729, D]`` only
    while that launch runs.
    """

    owner: object = attrs.field(repr=False, converter=weakref.ref)
    prepared: PreparedImage | None
    length: int  # KV positions its prefix takes: BOS and the image features
    features: torch.Tensor | None = attrs.field(default=None, repr=False)
    kv: torch.Tensor | None = attrs.field(default=None, repr=False)

    def made_by(self, backend: object) -> bool:
        return self.owner() is backend

    @property
    def encoded(self) -> bool:
        return self.features is not None or self.kv is not None
