"""The two layers every part of moondream2 shares: a GELU-tanh MLP and
multi-head attention over a fused qkv projection.

Attribute names (``fc1``/``fc2``, ``qkv``/``proj``) are the checkpoint's,
so ``load_state_dict`` maps its tensors without a renaming table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, out or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class FusedQKV(nn.Module):
    """q, k and v from one matmul; rows of ``qkv.weight`` are q, then k,
    then v, each head-major (head h owns rows h*d .. h*d + d - 1)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T, D]`` -> q, k, v, each ``[B, H, T, D/H]``."""
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads)   # [B, T, 3, H, hd]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return q, k, v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, hd]`` -> ``[B, T, D]`` through the output projection."""
        b, h, t, hd = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, t, h * hd))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.heads(x)
        # mask: bool [T, T] or broadcastable, True = may attend.
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
