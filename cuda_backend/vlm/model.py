"""A transformers vision-language model split into the parts a backend runs.

``VisionLanguage.of(vlm)`` takes a ``*ForConditionalGeneration`` model and
gives its text decoder as a causal LM that shares the weights (what
``CudaBackend`` serves), its image features function, and its image token.
Taken (``SUPPORTED``): architectures whose processor expands an image into
a block of ids holding one placeholder per feature, the features scattered
there in order (transformers' ``masked_scatter``), and 1-D rotary
positions: LLaVA (a fixed block), LLaVA-NeXT (a grid of crops chosen by
the image's size, its features unpadded with a newline feature a row),
Idefics3 and SmolVLM2 (tiles whose count follows the image's size, each
with its row and column tokens), PaliGemma
(the image, then BOS, before the text; the prompt attends both ways,
``PREFIX_LM``), Qwen2-VL and Qwen2.5-VL (3-D rotary positions over the
image, ``MROPE``). The others are refused, naming those served.
"""

from __future__ import annotations

import types
from typing import Any

import attrs
import torch
from transformers import AutoModelForCausalLM

from bubblefree.core.values import InvalidRequest
from bubblefree.cuda_backend.errors import UnsupportedModel

SUPPORTED = ("llava", "llava_next", "idefics3", "smolvlm", "paligemma", "qwen2_vl", "qwen2_5_vl")
# Whose rotary positions are 3-D over the image (mrope.py), and whose
# processor gives one image's patches as rows to concatenate, not a batch.
MROPE = ("qwen2_vl", "qwen2_5_vl")
# Whose prompt attends both ways (a prefix LM): the image and the question
# see each other; what the model writes after them is causal.
PREFIX_LM = ("paligemma",)
# The prompt layout of a model whose checkpoint has no chat template, as a
# template over typed parts: PaliGemma's processor writes the image, BOS,
# the text and a newline (without an image: BOS, the text, a newline).
TEMPLATES = {"paligemma": (
    "{% for m in messages %}{% set ns = namespace(image=false) %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% set ns.image = true %}{% endif %}"
    "{% endfor %}{% if not ns.image %}{{ bos_token }}{% endif %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}\n"
    "{% endfor %}")}


def supported(model_type: str) -> str | None:
    """None if ``model_type`` is served, else why not."""
    if model_type in SUPPORTED:
        return None
    return (f"model type '{model_type}' is not supported: no vision-language path here for it "
            f"(served: {', '.join(SUPPORTED)})")


@attrs.define(eq=False)
class VisionLanguage:
    vlm: torch.nn.Module  # the *ForConditionalGeneration model (owns every weight)
    text: torch.nn.Module  # its decoder as a *ForCausalLM, weights shared
    image_token_id: int
    prefix_lm: bool = False  # the prompt attends both ways (PREFIX_LM)
    mrope: bool = False  # 3-D rotary positions over the image (MROPE)

    @classmethod
    def of(cls, vlm: torch.nn.Module) -> VisionLanguage:
        config = vlm.config
        why = supported(config.model_type)
        if why:
            raise UnsupportedModel(f"{type(vlm).__name__}: {why}")
        language = _language_model(vlm.model)
        try:
            with torch.device("meta"):  # no weights of its own: they are the VLM's
                text = AutoModelForCausalLM.from_config(config.text_config)
            text.model, text.lm_head = language, vlm.lm_head
        except ValueError:  # no *ForCausalLM for this text config (Qwen2-VL's)
            text = TextLM(language, vlm.lm_head)
        text.config = language.config
        text.generation_config = vlm.generation_config
        return cls(vlm=vlm.eval(), text=text.eval(), image_token_id=int(config.image_token_id),
                   prefix_lm=config.model_type in PREFIX_LM, mrope=config.model_type in MROPE)

    @property
    def vision_parts(self) -> tuple[torch.nn.Module, ...]:
        """The vision tower (first) and what projects its output."""
        language = _language_model(self.vlm.model)
        return tuple(m for m in self.vlm.model.children() if m is not language)

    def image_features(self, **pixels: torch.Tensor) -> list[torch.Tensor]:
        """The processor's tensors for N images, batched (``pixel_values``
        in the model's dtype, and ``pixel_attention_mask`` where the model
        takes one) -> each image's features ``[tokens, D]``, in the order
        transformers scatters them into the prompt (its own
        ``get_image_features``)."""
        out: Any = self.vlm.model.get_image_features(**pixels)
        features = getattr(out, "pooler_output", out)
        images = pixels["pixel_values"].shape[0]
        if not self.mrope and isinstance(features, torch.Tensor) and features.shape[0] != images:
            # Idefics3's before transformers split them per image (5.17
            # does not): its tiles as rows, [tiles, tokens, D]. The images
            # of one call have the same shapes, so the same tile count.
            if features.shape[0] % images:
                raise InvalidRequest(f"image: the vision tower gave {features.shape[0]} tiles for {images} "
                                     "images of the same shape")
            features = features.view(images, -1, features.shape[-1])
        return [f.reshape(-1, f.shape[-1]) for f in features]


class TextLM(torch.nn.Module):
    """A language model and its head as a causal LM, where the text config
    has no *ForCausalLM class: transformers' call (``input_ids`` or
    ``inputs_embeds``, ``position_ids``, ``logits_to_keep``) to ``.logits``."""

    causal_decoder = True  # loader.use_paged_attention takes it as one

    def __init__(self, language: torch.nn.Module, lm_head: torch.nn.Module):
        super().__init__()
        self.model, self.lm_head = language, lm_head

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, logits_to_keep=None, **kwargs):
        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                            **kwargs).last_hidden_state
        if logits_to_keep is not None:  # the rows' last positions
            hidden = hidden[:, logits_to_keep]
        return types.SimpleNamespace(logits=self.lm_head(hidden))


def tile_features(config: Any) -> int:
    """Idefics3's and SmolVLM's features a tile: its patches, pixel-shuffled."""
    vision = config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2 / config.scale_factor ** 2)


def feature_count(config: Any, tensors: dict[str, torch.Tensor]) -> int:
    """How many features an image's tensors give (``pixels.TokenRepeat``):
    Qwen2-VL's, one per merged patch of its grid."""
    merge = config.vision_config.spatial_merge_size
    return int(tensors["image_grid_thw"].prod()) // merge ** 2


def _language_model(inner: torch.nn.Module) -> torch.nn.Module:
    language = getattr(inner, "language_model", None)
    return language if language is not None else inner.text_model  # Idefics3's name
