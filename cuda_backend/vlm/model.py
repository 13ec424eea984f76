"""A transformers vision-language model split into the parts a backend runs.

``VisionLanguage.of(vlm)`` takes a ``*ForConditionalGeneration`` model and
gives its text decoder as a causal LM that shares the weights (what
``CudaBackend`` serves), its image features function, and its image token.
Taken (``SUPPORTED``): architectures whose processor expands an image into
a block of ids holding one placeholder per feature, the features scattered
there in order (transformers' ``masked_scatter``), and 1-D rotary
positions: LLaVA (a fixed block), LLaVA-NeXT (a grid of crops chosen by
the image's size, its features unpadded with a newline feature a row),
Idefics3 (SmolVLM: tiles whose count follows the image's size, each with
its row and column tokens), PaliGemma
(the image, then BOS, before the text; the prompt attends both ways,
``PREFIX_LM``). The others are refused with what they would need.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from transformers import AutoModelForCausalLM

from bubblefree.cuda_backend.errors import UnsupportedModel

# model_type -> why it is not served here (the rest of issue 13's list).
NOT_YET = {
    "qwen2_vl": "its rotary positions are 3-D (time, height, width) over the image, so after it a "
                "row's rotary position is not its KV position",
    "qwen2_5_vl": "its rotary positions are 3-D (time, height, width) over the image, so after it a "
                  "row's rotary position is not its KV position",
    "smolvlm": "its processor needs num2words and a video processor (SmolVLM checkpoints of model "
               "type idefics3 are served)",
}
SUPPORTED = ("llava", "llava_next", "idefics3", "paligemma")
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
    why = NOT_YET.get(model_type, "it is not a LLaVA-shaped vision-language model")
    return f"model type '{model_type}' is not supported: {why}"


@attrs.define(eq=False)
class VisionLanguage:
    vlm: torch.nn.Module  # the *ForConditionalGeneration model (owns every weight)
    text: torch.nn.Module  # its decoder as a *ForCausalLM, weights shared
    image_token_id: int
    prefix_lm: bool = False  # the prompt attends both ways (PREFIX_LM)

    @classmethod
    def of(cls, vlm: torch.nn.Module) -> VisionLanguage:
        config = vlm.config
        why = supported(config.model_type)
        if why:
            raise UnsupportedModel(f"{type(vlm).__name__}: {why}")
        language = _language_model(vlm.model)
        with torch.device("meta"):  # no weights of its own: they are the VLM's
            text = AutoModelForCausalLM.from_config(config.text_config)
        text.model = language
        text.lm_head = vlm.lm_head
        text.config = language.config
        text.generation_config = vlm.generation_config
        return cls(vlm=vlm.eval(), text=text.eval(), image_token_id=int(config.image_token_id),
                   prefix_lm=config.model_type in PREFIX_LM)

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
        return [f.reshape(-1, f.shape[-1]) for f in features]


def _language_model(inner: torch.nn.Module) -> torch.nn.Module:
    language = getattr(inner, "language_model", None)
    return language if language is not None else inner.text_model  # Idefics3's name
