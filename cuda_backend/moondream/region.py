"""The region module: coordinates and sizes in and out of the text model.

Going in, a value becomes an input embedding: Fourier features
``[cos(2 pi v @ F), sin(2 pi v @ F)]`` of the value under a learned
frequency matrix F, then a linear map to the text width. Coming out, the
hidden state at a coordinate or size position goes through an MLP to
logits over bins: 1024 for a coordinate in [0, 1]; 2 x 1024 for (width,
height), whose bins are log-spaced (see ``size_value``).

Which hidden state: the last block's output before the final LayerNorm
(the LM head's norm is the LM head's own).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bubblefree.cuda_backend.moondream.config import RegionConfig
from bubblefree.cuda_backend.moondream.layers import MLP


def fourier_features(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` values, ``[k, f]`` frequencies -> ``[..., 2f]`` (cos half, then sin)."""
    angles = 2 * math.pi * (x @ freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class RegionModel(nn.Module):
    def __init__(self, config: RegionConfig):
        super().__init__()
        self.config = config
        self.coord_features = nn.Parameter(torch.zeros(1, config.coord_feat_dim // 2))
        self.coord_encoder = nn.Linear(config.coord_feat_dim, config.dim)
        self.coord_decoder = MLP(config.dim, config.inner_dim, config.coord_out_dim)
        self.size_features = nn.Parameter(torch.zeros(2, config.size_feat_dim // 2))
        self.size_encoder = nn.Linear(config.size_feat_dim, config.dim)
        self.size_decoder = MLP(config.dim, config.inner_dim, config.size_out_dim)

    def encode_coordinate(self, coord: torch.Tensor) -> torch.Tensor:
        """``[..., 1]`` in [0, 1] -> embeddings ``[..., dim]``."""
        return self.coord_encoder(fourier_features(coord, self.coord_features))

    def decode_coordinate(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` -> logits ``[..., 1024]``."""
        return self.coord_decoder(hidden)

    def encode_size(self, size: torch.Tensor) -> torch.Tensor:
        """``[..., 2]`` (width, height) as fractions of the image -> ``[..., dim]``."""
        return self.size_encoder(fourier_features(size, self.size_features))

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., dim]`` -> logits ``[..., 2, 1024]`` (width row, height row)."""
        logits = self.size_decoder(hidden)
        return logits.view(*logits.shape[:-1], 2, -1)


def coordinate_value(bins: torch.Tensor, n_bins: int) -> torch.Tensor:
    """A coordinate bin -> its value in [0, 1): bin / n_bins."""
    return bins.float() / n_bins


def size_value(bins: torch.Tensor, n_bins: int) -> torch.Tensor:
    """A size bin -> its value in [2^-10, 1], log-spaced: small boxes get
    fine steps, large ones coarse."""
    return torch.pow(2.0, bins.float() / (n_bins - 1) * 10.0 - 10.0)
