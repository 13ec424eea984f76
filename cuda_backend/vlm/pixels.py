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


# The most pixels an image's processor may resize it to. LLaVA's (CLIP's)
# resizes the shortest edge to 336 before it crops: a 1 x 1,000,000 image,
# 4 KB and a million pixels, became 336 x 336,000,000 on the caller's thread
# (a 1 x 5,000 one took 18 s and 6 GB). Processors resize to a few million
# pixels at most; past this bound the image is refused before the resize.
RESIZED_MAX_PIXELS = 4096 * 4096


def check_resize(processor: Any, image: Any) -> None:
    """Refuse ``image`` if ``processor`` would resize its shortest edge up
    to an image past ``RESIZED_MAX_PIXELS``: a processor that resizes to
    ``size["shortest_edge"]`` and then center-crops (CLIP's, LLaVA's and
    LLaVA-NeXT's). Others bound their output by themselves (Qwen2-VL's
    ``shortest_edge`` is a pixel count, and it refuses past 200:1)."""
    images = getattr(processor, "image_processor", processor)
    if getattr(images, "do_resize", True) is False or not getattr(images, "do_center_crop", False):
        return
    size = getattr(images, "size", None)
    short = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
    if not isinstance(short, int):
        return
    w, h = image.size
    scale = short / min(w, h)
    wide, high = round(w * scale), round(h * scale)
    if wide * high > RESIZED_MAX_PIXELS:
        most = RESIZED_MAX_PIXELS // (short * short)
        raise InvalidRequest(f"image: {w}x{h}; the model's processor resizes its shortest edge to {short}, "
                             f"which makes it {wide}x{high}, past the {RESIZED_MAX_PIXELS} pixels this "
                             f"server resizes to (an aspect ratio of at most {most}:1 is taken)")


def expand(processor: Any, image: Any, token: str,
           rows: bool = False) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
    """One RGB PIL image through ``processor`` with the text ``token`` ->
    (block ids, the tower's tensors without their batch dim; with ``rows``,
    as they are: the image's patches as rows, Qwen2-VL's)."""
    check_resize(processor, image)
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
