"""Images to pixels on the caller's thread: the model's own image processor.

``VlmPixels`` is an ``ImageRef``'s source: the processor's ``pixel_values``
for one image, in pinned memory on CUDA, so the image prefill copies them
without waiting. ``owner`` ties it to the backend that made it.

An encoded image (``encode``: meant for several questions) also keeps its
features on the device: the first image prefill that uses it sets them at
launch (later steps read them in stream order), and a step that fails
forgets them, so the next one encodes again. Only the decode thread sets or
reads them once the image is handed to the engine.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch

from bubblefree.core.values import InvalidRequest


@attrs.define(eq=False)
class VlmPixels:
    pixels: torch.Tensor  # [3, H, W] float32, pinned on CUDA
    _owner: Any = attrs.field(repr=False, alias="owner", converter=weakref.ref)
    keep: bool = False  # an encoded image: its features stay on the device
    features: torch.Tensor | None = attrs.field(default=None, repr=False)  # [F, D] device

    def made_by(self, backend: Any) -> bool:
        return self._owner() is backend


def pixel_values(processor: Any, image: Any) -> torch.Tensor:
    """One RGB PIL image through ``processor`` -> ``[3, H, W]`` float32."""
    out = processor(images=[image], return_tensors="pt")  # "pt": every processor's, fast or not
    values = torch.as_tensor(out["pixel_values"]).to(torch.float32)
    if values.ndim != 4 or values.shape[0] != 1:
        raise InvalidRequest(f"image: the model's image processor gave pixel values of shape "
                             f"{tuple(values.shape)}; one [3, H, W] image was expected")
    return values[0].contiguous()


def prepare(processor: Any, image: Any, shape: tuple[int, ...], pin: bool, owner: Any,
            keep: bool = False) -> VlmPixels:
    pixels = pixel_values(processor, image)
    if tuple(pixels.shape) != shape:
        raise InvalidRequest(f"image: the model's image processor gave {tuple(pixels.shape)} "
                             f"pixels, the model takes {shape}")
    return VlmPixels(pixels.pin_memory() if pin else pixels, owner=owner, keep=keep)
