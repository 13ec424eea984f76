"""Pillow's Lanczos resize of an 8-bit image, bit for bit, on any torch device.

Cutting a large image into moondream's crops is mostly two Lanczos
resizes, which Pillow runs on the CPU: about 20 ms for a 756-px image, on
the caller's thread, before the request is even handed over. The same
arithmetic as matrix products is a few GFLOP for such an image, a small
load for a GPU (not yet timed on one).

Pillow's 8-bit path (``Resample.c``) works in fixed point: each output
pixel of a pass is ``clip8((2**21 + sum(pixel * k)) >> 22)`` over integer
coefficients ``k`` (its double coefficients, normalized to sum 1, times
2**22 and rounded half away from zero), one axis after the other on the
rounded 8-bit result of the first. Here the coefficients are computed
the same way (``taps``; numpy's ``sin`` agrees with the C library's on
these arguments, which the tests check against Pillow), and each pass is
one float64 matrix product: every product and sum is an integer below
2**53, so float64 holds it exactly in any order, and the shift is a floor
division by a power of two. The result equals Pillow's, pass by pass:
``resize`` runs one axis, then the other, in the order ``width_first``
picks, as ``image_crops`` asks Pillow to; Pillow's own two-axis ``resize``
orders its passes by size in recent versions, so a two-axis call may
differ from it.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images
SUPPORT = 3.0  # Lanczos-3
CHUNK_ELEMENTS = 1 << 23  # float64 elements per block of a pass: 64 MB


def _sinc(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        y = x * math.pi
        return np.where(x == 0.0, 1.0, np.sin(y) / y)


@functools.lru_cache(maxsize=256)
def taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's coefficients for resizing an axis of ``in_size`` to
    ``out_size`` pixels: (first input pixel ``[out]``, fixed-point weights
    ``[out, k]``, zero past each output's window), both int64."""
    if in_size < 1 or out_size < 1:
        raise ValueError(f"sizes must be positive, got {in_size} -> {out_size}")
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = SUPPORT * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    # C's (int) casts truncate; below zero the bound is clamped to 0 anyway.
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    last = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    count = last - first
    x = np.arange(ksize, dtype=np.int64)
    inside = x[None, :] < count[:, None]
    arg = ((x[None, :] + first[:, None]).astype(np.float64) - center[:, None] + 0.5) * (1.0 / filterscale)
    w = np.where((arg >= -SUPPORT) & (arg < SUPPORT), _sinc(arg) * _sinc(arg / 3.0), 0.0)
    w = np.where(inside, w, 0.0)
    total = np.cumsum(w, axis=1)[:, -1]  # Pillow adds the weights in order: cumsum does too
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    scaled = w * float(1 << PRECISION_BITS)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int64)
    first.setflags(write=False)  # cached: shared by every caller
    fixed.setflags(write=False)
    return first, fixed


def _matrix(in_size: int, out_size: int, device: torch.device) -> torch.Tensor:
    """The pass as a dense ``[out, in]`` float64 matrix of the fixed-point weights."""
    first, fixed = taps(in_size, out_size)
    cols = torch.as_tensor(np.minimum(first[:, None] + np.arange(fixed.shape[1]), in_size - 1), device=device)
    weights = torch.as_tensor(fixed.astype(np.float64), device=device)  # a copy: the cached one is read-only
    # Past a window the weight is zero, so clamped duplicate columns add nothing.
    return torch.zeros(out_size, in_size, dtype=torch.float64, device=device).scatter_add_(1, cols, weights)


def _pass(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, in, m]`` -> uint8 ``[n, out, m]``: one Pillow pass along
    axis 1, in blocks of ``n`` and ``m`` that bound the float64 working set."""
    n, size, m = x.shape
    out = torch.empty((n, weights.shape[0], m), dtype=torch.uint8, device=x.device)
    per = max(1, CHUNK_ELEMENTS // (size + weights.shape[0]))  # (row, column) pairs a block holds
    rows, cols = max(1, per // m), min(m, per)
    half, unit = float(1 << (PRECISION_BITS - 1)), float(1 << PRECISION_BITS)
    for a in range(0, n, rows):
        for b in range(0, m, cols):
            acc = torch.matmul(weights, x[a:a + rows, :, b:b + cols].to(torch.float64))  # [r, out, c]
            out[a:a + rows, :, b:b + cols] = acc.add_(half).div_(unit).floor_().clamp_(0, 255).to(torch.uint8)
    return out


def width_first(h: int, w: int, height: int, width: int) -> bool:
    """Whether an ``h`` x ``w`` image resized to ``height`` x ``width`` one
    axis at a time takes the width first: the order whose middle image is
    smaller (ties: the width). A 1 x 2,000,000 image to 378 x 1 resized
    width first was 378 times its size in between (gigabytes, within the
    pixel limit); for images of ordinary shape the two orders tie."""
    return width * h <= w * height


def resize(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 ``[H, W, C]`` (any device) -> ``[height, width, C]``, equal to
    Pillow's Lanczos resizes of one axis and then the other, in
    ``width_first``'s order; an axis already of its size is left as it is."""
    if pixels.dtype != torch.uint8 or pixels.dim() != 3:
        raise ValueError(f"expected uint8 [H, W, C] pixels, got {pixels.dtype} {tuple(pixels.shape)}")
    h, w, c = pixels.shape
    x = pixels
    if width_first(h, w, height, width):
        if width != w:
            x = _pass(x, _matrix(w, width, x.device))
        if height != h:
            x = _pass(x.reshape(1, h, width * c), _matrix(h, height, x.device)).reshape(height, width, c)
        return x
    if height != h:
        x = _pass(x.reshape(1, h, w * c), _matrix(h, height, x.device)).reshape(height, w, c)
    if width != w:
        x = _pass(x, _matrix(w, width, x.device))
    return x
