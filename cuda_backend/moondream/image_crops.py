"""Overlapping multi-crop tiling of an image, and the way back for features.

moondream2 sees an image twice: a global view (the whole image squashed to
one 378-px crop) and up to 12 local crops of a resized copy. Neighbouring
local crops share ``overlap_margin`` patches (4 x 14 = 56 px) on each side,
so every patch of the interior is seen by some crop with context around it.
Each local crop contributes its central 19 x 19 patches (27 - 2 * 4) to
the reconstructed grid; crops on the image's border also keep their outer
margin, so the grid is ``rows * 19 + 8`` by ``cols * 19 + 8`` patches.

The image is resized (aspect not kept) to exactly
``tiles * 266 + 112`` px per axis, so every crop window is a full 378-px
square inside it: no padding, for any input size, 1 x 1 included.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import attrs
import numpy as np
import torch
from PIL import Image

from bubblefree.cuda_backend.moondream.config import VisionConfig
from bubblefree.cuda_backend.moondream.resample import resize, width_first


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops for an image whose interior (the image
    less both margins) is ``height`` x ``width`` px, each crop adding a
    ``window``-px step. Enough tiles to cover the interior at native
    resolution where that fits in ``max_crops``; otherwise scaled down
    keeping the aspect. A thin interior gets one crop."""
    if height <= window or width <= window:
        return 1, 1
    min_rows, min_cols = math.ceil(height / window), math.ceil(width / window)
    if min_rows * min_cols > max_crops:
        shrink = math.sqrt(max_crops / (min_rows * min_cols))
        return max(1, math.floor(min_rows * shrink)), max(1, math.floor(min_cols * shrink))
    # Room to spare: spend it on resolution, split by the aspect ratio.
    rows = max(math.floor(math.sqrt(max_crops * height / width)), min_rows)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), min_cols)
    if rows * cols > max_crops:
        if cols > rows:
            cols = max_crops // rows
        else:
            rows = max_crops // cols
    return max(1, rows), max(1, cols)


@attrs.frozen
class CropPlan:
    """Where the local crops lie, in pixels of the resized image."""

    tiling: tuple[int, int]              # (rows, cols) of local crops
    resized: tuple[int, int]             # (height, width) the image is resized to
    windows: tuple[tuple[int, int, int, int], ...]   # (y0, y1, x0, x1), row-major

    @property
    def n_crops(self) -> int:
        """Local crops plus the global view."""
        return len(self.windows) + 1


def window_step(config: VisionConfig) -> int:
    """Pixels from one local crop's window to the next: a crop less the
    margins it shares with its neighbours."""
    return (config.grid - 2 * config.overlap_margin) * config.patch_size


def plan_crops(height: int, width: int, config: VisionConfig) -> CropPlan:
    margin_px = config.overlap_margin * config.patch_size            # 56
    step = window_step(config)                                       # 266
    rows, cols = select_tiling(height - 2 * margin_px, width - 2 * margin_px, step,
                               config.max_crops)
    resized = (rows * step + 2 * margin_px, cols * step + 2 * margin_px)
    windows = tuple((i * step, i * step + config.crop_size, j * step, j * step + config.crop_size)
                    for i in range(rows) for j in range(cols))
    return CropPlan(tiling=(rows, cols), resized=resized, windows=windows)


def overlap_crops(image: Image.Image, config: VisionConfig, pin: bool = False) -> tuple[torch.Tensor, CropPlan]:
    """An RGB image -> (crops ``[n, S, S, 3]`` uint8, the plan); crop 0 is
    the global view, then the local crops row by row. ``pin``: written
    straight into pinned memory (no second copy to pin them)."""
    if image.mode != "RGB":
        raise ValueError(f"overlap_crops needs an RGB image, got mode {image.mode!r}")
    plan = plan_crops(image.height, image.width, config)
    size = config.crop_size
    out = torch.empty((plan.n_crops, size, size, 3), dtype=torch.uint8, pin_memory=pin)
    crops = out.numpy()                                                # [n, S, S, 3], the same memory
    height, width = plan.resized
    if (height, width) == (size, size):
        # One local crop of the global view's size (a side of at most 378 px,
        # or a 1 x 1 tiling) is the global view again: resized once, not twice.
        crops[0] = local = _resized(image, (size, size))
    else:
        # Two resizes of one source, side by side: PIL's resampling runs
        # without the GIL, and on a large image these two are most of a
        # request's preparation, on the caller's thread.
        with ThreadPoolExecutor(1, thread_name_prefix="bubblefree-crops") as pool:
            global_view = pool.submit(_resized, image, (size, size))
            local = _resized(image, (height, width))                   # [H, W, 3]
            crops[0] = global_view.result()
    for k, (y0, y1, x0, x1) in enumerate(plan.windows):
        crops[k + 1] = local[y0:y1, x0:x1]
    return out, plan


def _resized(image: Image.Image, shape: tuple[int, int]) -> np.ndarray:
    """``image`` resized to ``shape`` (height, width) as an array: Lanczos,
    one axis at a time in ``resample.width_first``'s order (the smaller
    middle image), each pass rounded to 8 bits (what ``resample.resize``
    computes on a device, pixel for pixel; Pillow's own two-axis resize
    picks the order by size, which depends on its version). One of that
    size already is read as it is."""
    height, width = shape
    lanczos = Image.Resampling.LANCZOS
    if width_first(image.height, image.width, height, width):
        if image.width != width:
            image = image.resize((width, image.height), lanczos)
        if image.height != height:
            image = image.resize((width, height), lanczos)
    else:
        if image.height != height:
            image = image.resize((image.width, height), lanczos)
        if image.width != width:
            image = image.resize((width, height), lanczos)
    return np.asarray(image)


def overlap_crops_on(pixels: torch.Tensor, config: VisionConfig) -> tuple[torch.Tensor, CropPlan]:
    """``overlap_crops`` of uint8 ``[H, W, 3]`` pixels on their own device
    (the resizes as matrix products: ``resample``), equal to it pixel for
    pixel."""
    if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.shape[2] != 3:
        raise ValueError(f"overlap_crops_on needs uint8 [H, W, 3] pixels, got {pixels.dtype} "
                         f"{tuple(pixels.shape)}")
    plan = plan_crops(pixels.shape[0], pixels.shape[1], config)
    size, (rows, cols) = config.crop_size, plan.tiling
    crops = torch.empty((plan.n_crops, size, size, 3), dtype=torch.uint8, device=pixels.device)
    crops[0] = resize(pixels, size, size)
    local = crops[0] if plan.resized == (size, size) else resize(pixels, *plan.resized)
    step = window_step(config)
    # Every window at once: [rows, cols, 3, S, S] views of the resized image.
    windows = local.unfold(0, size, step).unfold(1, size, step)
    crops[1:] = windows.permute(0, 1, 3, 4, 2).reshape(rows * cols, size, size, 3)
    return crops, plan


def reconstruct(local: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """Local crops' features ``[rows * cols, g, g, C]`` (row-major) -> one
    grid ``[rows * (g - 2m) + 2m, cols * (g - 2m) + 2m, C]``.

    Each crop gives its interior; a crop on the grid's edge also gives the
    margin on that side, which no other crop covers. Overlapping margins
    are dropped, not averaged: the interior copy saw more context.
    """
    rows, cols = tiling
    n, g, g2, channels = local.shape
    if n != rows * cols or g != g2:
        raise ValueError(f"expected {rows * cols} square crops, got {tuple(local.shape)}")
    inner = g - 2 * margin
    out = local.new_zeros(rows * inner + 2 * margin, cols * inner + 2 * margin, channels)
    for k in range(n):
        i, j = divmod(k, cols)
        y0 = 0 if i == 0 else margin
        y1 = g if i == rows - 1 else g - margin
        x0 = 0 if j == 0 else margin
        x1 = g if j == cols - 1 else g - margin
        out[i * inner + y0:i * inner + y1, j * inner + x0:j * inner + x1] = local[k, y0:y1, x0:x1]
    return out
