"""A transformers vision-language model split into the parts a backend runs.

``VisionLanguage.of(vlm)`` takes a ``*ForConditionalGeneration`` model and
gives its text decoder as a causal LM that shares the weights (what
``CudaBackend`` serves), its image features function, and its image token.
Only architectures whose image features are a fixed number of positions
placed by ``masked_scatter`` into a causally attended prompt, with 1-D
rotary positions, are taken (``SUPPORTED``); the others are refused with
what they would need.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from transformers import AutoModelForCausalLM

from bubblefree.cuda_backend.errors import UnsupportedModel

# model_type -> why it is not served here (the rest of issue 13's list).
NOT_YET = {
    "paligemma": "its prompt attends both ways over the image and the question (a prefix mask), "
                 "and it has no chat template: its processor puts the image before BOS",
    "qwen2_vl": "its rotary positions are 3-D (time, height, width) over the image",
    "qwen2_5_vl": "its rotary positions are 3-D (time, height, width) over the image",
    "idefics3": "an image is split into tiles whose count depends on its size, each with its own "
                "row and column tokens",
    "smolvlm": "an image is split into tiles whose count depends on its size, each with its own "
               "row and column tokens",
    "llava_next": "an image is cut into a grid that depends on its size (anyres), with newline "
                  "features between rows",
}
SUPPORTED = ("llava",)


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

    @classmethod
    def of(cls, vlm: torch.nn.Module) -> VisionLanguage:
        config = vlm.config
        why = supported(config.model_type)
        if why:
            raise UnsupportedModel(f"{type(vlm).__name__}: {why}")
        inner = vlm.model
        with torch.device("meta"):  # no weights of its own: they are the VLM's
            text = AutoModelForCausalLM.from_config(config.text_config)
        text.model = inner.language_model
        text.lm_head = vlm.lm_head
        text.config = inner.language_model.config
        text.generation_config = vlm.generation_config
        return cls(vlm=vlm.eval(), text=text.eval(), image_token_id=int(config.image_token_id))

    @property
    def vision_parts(self) -> tuple[torch.nn.Module, ...]:
        inner = self.vlm.model
        return inner.vision_tower, inner.multi_modal_projector

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels`` ``[N, 3, H, W]`` (the image processor's, in the model's
        dtype) -> features ``[N, F, D]``, what transformers scatters into
        the prompt (its own ``get_image_features``)."""
        out: Any = self.vlm.model.get_image_features(pixel_values=pixels)
        features = getattr(out, "pooler_output", out)
        if isinstance(features, (list, tuple)):
            features = torch.stack(list(features))
        return features
