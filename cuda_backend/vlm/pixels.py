"""Images to a block of ids and pixels, on the caller's thread: the model's
own processor.

``expand`` runs the processor on the image token's text and one image: the
ids it expands the token into (the block: one placeholder per feature, and
for Idefics3 the tiles' row, column and wrapper tokens between them) and
the tensors the vision tower takes. ``VlmPixels`` is an ``ImageRef``'s
source: those, the tensors in pinned memory on CUDA so the image prefill
copies them without waiting, and ``owner``, the backend that made it.

An encoded image (``keep``: meant for several questions) also keeps, on
the device, its prefix's KV (``image_prefill``), or on a prefix LM, whose
image attends to the question, its features: the first image prefill that
uses it sets them at launch (later steps read them in stream order), and a
step that fails forgets them, so the next one encodes again. Only the
decode thread sets or reads them once the image is handed to the engine.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch

from bubblefree.core.values import InvalidRequest

# What of a processor's output the vision tower takes, beside the input ids.
TOWER_INPUTS = ("pixel_values", "pixel_attention_mask", "image_sizes", "image_grid_thw")


@attrs.define(eq=False)
class VlmPixels:
    block: tuple[int, ...]  # the image's ids: placeholders and the tokens around them
    tensors: dict[str, torch.Tensor]  # TOWER_INPUTS of one image (no batch dim), pinned on CUDA
    _owner: Any = attrs.field(repr=False, alias="owner", converter=weakref.ref)
    keep: bool = False  # an encoded image: its prefix KV (a prefix LM's: features) stays on the device
    features: torch.Tensor | None = attrs.field(default=None, repr=False)  # [tokens, D] device
    kv: torch.Tensor | None = attrs.field(default=None, repr=False)  # its prefix's [L, 2, m, KVH, D] device

    def made_by(self, backend: Any) -> bool:
        return self._owner() is backend

    @property
    def shapes(self) -> tuple:
        return tuple((k, tuple(v.shape)) for k, v in sorted(self.tensors.items()))


class TokenRepeat:
    """A processor made of an image processor: an image's block is the image
    token ``token_id`` once per feature, ``count(tensors)`` of them, then
    ``after``, as the model's own processor expands it. For checkpoints
    whose processor cannot load here (Qwen2-VL's wants a video processor,
    which needs torchvision), or writes more than the image around any text
    (PaliGemma's: BOS after the image, a newline after the text)."""

    def __init__(self, image_processor: Any, tokenizer: Any, token_id: int, count: Any,
                 after: tuple[int, ...] = ()):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.token_id, self.count, self.after = token_id, count, after

    def __call__(self, text: str, images: list, **_: Any) -> dict:
        out = dict(self.image_processor(images=images, return_tensors="pt"))
        return {**out, "input_ids": torch.tensor([[self.token_id] * self.count(out) + list(self.after)])}


def expand(processor: Any, image: Any, token: str,
           rows: bool = False) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
    """One RGB PIL image through ``processor`` with the text ``token`` ->
    (block ids, the tower's tensors without their batch dim; with ``rows``,
    as they are: the image's patches as rows, Qwen2-VL's)."""
    try:
        out = processor(text=token, images=[image], return_tensors="pt", add_special_tokens=False)
    except (ValueError, TypeError) as err:  # e.g. Qwen2-VL's: an aspect ratio past 200:1
        raise InvalidRequest(f"image: the model's image processor refused it ({err}); "
                             f"it is {image.width}x{image.height}") from err
    ids = torch.as_tensor(out["input_ids"])
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise InvalidRequest(f"image: the model's processor gave input ids of shape {tuple(ids.shape)}")
    tensors = {}
    for name in TOWER_INPUTS:
        if name in out:
            value = torch.as_tensor(out[name])
            if rows:
                tensors[name] = value.contiguous()
                continue
            if value.shape[0] != 1:
                raise InvalidRequest(f"image: the model's processor gave {name} of shape {tuple(value.shape)} "
                                     "for one image")
            tensors[name] = value[0].contiguous()
    if "pixel_values" not in tensors:
        raise InvalidRequest("image: the model's processor gave no pixel_values")
    tensors["pixel_values"] = tensors["pixel_values"].to(torch.float32)
    return tuple(int(t) for t in ids[0].tolist()), tensors


def prepare(processor: Any, image: Any, token: str, pin: bool, owner: Any, keep: bool = False,
            rows: bool = False) -> VlmPixels:
    block, tensors = expand(processor, image, token, rows)
    if pin:
        tensors = {k: v.pin_memory() for k, v in tensors.items()}
    return VlmPixels(block, tensors, owner=owner, keep=keep)
