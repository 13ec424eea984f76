"""The three parts of moondream2 under one module, named as in its
checkpoint (``vision``, ``text``, ``region``), and the image prefix they
make together.

The image prefix is what the image prefill step will feed the text model:
BOS's embedding, then the 729 projected image positions
``[1 + 729, text dim]``. The prompt's tokens follow it, causal.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from bubblefree.cuda_backend.moondream.config import MoondreamConfig
from bubblefree.cuda_backend.moondream.image_crops import overlap_crops
from bubblefree.cuda_backend.moondream.region import RegionModel
from bubblefree.cuda_backend.moondream.text import TextDecoder
from bubblefree.cuda_backend.moondream.vision import VisionEncoder


class Moondream(nn.Module):
    def __init__(self, config: MoondreamConfig):
        super().__init__()
        self.config = config
        self.vision = VisionEncoder(config.vision)
        self.text = TextDecoder(config.text)
        self.region = RegionModel(config.region)

    @torch.inference_mode()
    def image_prefix(self, image: Image.Image) -> torch.Tensor:
        """An RGB image -> prefix embeddings ``[prefix_attn, text dim]``."""
        device = self.text.wte.device
        crops, plan = overlap_crops(image, self.config.vision)
        embeds = self.vision(crops.to(device), plan.tiling)                 # [729, D]
        bos = self.text.embed(torch.tensor([self.config.tokenizer.bos_id], device=device))
        return torch.cat([bos, embeds], dim=0)                               # [730, D]
