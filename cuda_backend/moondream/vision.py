"""moondream2's vision side: a SigLIP-style encoder over each crop, and the
projection of (global features, reconstructed local features) into the
text model's embedding space.

Per crop: the 378 x 378 pixels are cut into 27 x 27 patches of 14 x 14,
each flattened channel-major (C, 14, 14) -- the order a Conv2d kernel's
weight flattens in, so a SigLIP checkpoint's patch conv maps onto
``patch_emb`` by a reshape. A learned position embedding per patch, 27
pre-norm blocks, a final LayerNorm.

Projection: the local grid (any rows x cols of 19-patch tiles plus the
margins) is average-pooled back to 27 x 27, concatenated with the global
view patch by patch ``[729, 2 * 1152]`` and mapped by an MLP to the text
width ``[729, 2048]``. So an image always costs 729 prefix positions,
however many crops it was cut into.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bubblefree.cuda_backend.moondream.config import VisionConfig
from bubblefree.cuda_backend.moondream.image_crops import reconstruct
from bubblefree.cuda_backend.moondream.layers import MLP, FusedQKV


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim, eps=config.ln_eps)
        self.attn = FusedQKV(config.dim, config.n_heads)
        self.ln2 = nn.LayerNorm(config.dim, eps=config.ln_eps)
        self.mlp = MLP(config.dim, config.ff_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))       # bidirectional over the crop's patches
        return x + self.mlp(self.ln2(x))


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, (H/p) * (W/p), C * p * p]``, patches row-major,
    each flattened (C, p, p)."""
    b, c, h, w = pixels.shape
    x = pixels.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


def normalize(crops: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[n, S, S, 3]`` -> ``[n, 3, S, S]`` in [-1, 1] (mean 0.5, std 0.5)."""
    return crops.permute(0, 3, 1, 2).to(dtype).div(255.0).sub(0.5).div(0.5)


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        patch_in = config.in_channels * config.patch_size ** 2
        self.patch_emb = nn.Linear(patch_in, config.dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, config.n_patches, config.dim))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.n_layers))
        self.post_ln = nn.LayerNorm(config.dim, eps=config.ln_eps)
        self.proj_mlp = MLP(2 * config.dim, config.proj_inner_dim, config.proj_out_dim)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalized crops ``[n, 3, S, S]`` -> features ``[n, 729, dim]``."""
        x = self.patch_emb(patchify(pixels, self.config.patch_size)) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.post_ln(x)

    def pool(self, grid: torch.Tensor) -> torch.Tensor:
        """A local grid ``[h, w, dim]`` -> ``[729, dim]``. Adaptive pooling: a
        1 x 1 tiling's 27 x 27 grid passes through unchanged; larger grids
        average into 27 x 27 cells."""
        g = self.config.grid
        pooled = F.adaptive_avg_pool2d(grid.permute(2, 0, 1), (g, g))      # [dim, 27, 27]
        return pooled.permute(1, 2, 0).reshape(g * g, -1)                   # [729, dim]

    def project(self, global_features: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """Global ``[729, dim]`` and local grid ``[h, w, dim]`` -> ``[729, out]``."""
        return self.proj_mlp(torch.cat([global_features, self.pool(grid)], dim=-1))

    def embed(self, crops: torch.Tensor, tilings: list[tuple[int, int]]) -> torch.Tensor:
        """Several images at once: uint8 crops ``[N, S, S, 3]``, each image's
        crops consecutive (global first, from ``overlap_crops``), and each
        image's tiling -> image embeddings ``[k, 729, text dim]``. One encoder
        call over all N crops (a crop attends only within itself, so batching
        changes nothing), one projection over all k images."""
        return self.project_images(self.encode(normalize(crops, self.patch_emb.weight.dtype)),
                                   tilings)

    def project_images(self, features: torch.Tensor,
                       tilings: list[tuple[int, int]]) -> torch.Tensor:
        """``encode``'s features ``[N, 729, dim]`` of several images' crops
        (each image's consecutive, global first) -> ``[k, 729, text dim]``."""
        g, at = self.config.grid, 0
        views = []
        for rows, cols in tilings:
            n = rows * cols
            local = features[at + 1:at + 1 + n].reshape(n, g, g, self.config.dim)
            grid = reconstruct(local, (rows, cols), self.config.overlap_margin)
            views.append(torch.cat([features[at], self.pool(grid)], dim=-1))   # [729, 2 * dim]
            at += 1 + n
        if at != features.shape[0]:
            raise ValueError(f"tilings cover {at} crops, got {features.shape[0]}")
        return self.proj_mlp(torch.stack(views))                             # [k, 729, out]

    def forward(self, crops: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """uint8 crops ``[n, S, S, 3]`` (global first, from ``overlap_crops``)
        -> image embeddings ``[729, text dim]``."""
        return self.embed(crops, [tiling])[0]
