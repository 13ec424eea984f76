"""moondream2's text decoder: Phi-1.5's shape, with the image prefix
attending both ways.

Each block is Phi's parallel block: one LayerNorm feeds both attention and
the MLP, and both add to the residual. Rotary covers the first half of each
head (NeoX layout: the rotated half's first and second quarters pair up).

The mask: positions 0 .. prefix_attn - 1 (BOS and the 729 image positions)
see each other in both directions; every later position is causal (it sees
the whole prefix and the text before it). ``prefix_mask`` builds it for
any run of query positions, so a chunked prefill or a decode step after a
cached prefix gets the same rule.

``PhiForCausalLM`` is the same network under other names: ``phi_config``
and ``phi_state_dict`` carry a decoder over, so the engine's existing Phi
paths (paged attention, the fused decode) can run moondream's text model.
They must be given the prefix mask for the image prefill; decode steps are
causal anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PhiConfig, PhiForCausalLM

from bubblefree.cuda_backend.moondream.config import TextConfig
from bubblefree.cuda_backend.moondream.layers import MLP, FusedQKV


def prefix_mask(query_positions: torch.Tensor, key_len: int, prefix: int) -> torch.Tensor:
    """bool ``[Tq, key_len]``, True = may attend, for queries at
    ``query_positions`` ``[Tq]`` over keys at 0 .. key_len - 1."""
    q = query_positions[:, None]                                     # [Tq, 1]
    k = torch.arange(key_len, device=query_positions.device)[None]  # [1, Tk]
    return (k <= q) | ((q < prefix) & (k < prefix))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``[Tq, Tk]`` -> ``[1, 1, Tq, Tk]`` of 0 / dtype-min, the 4-D form
    transformers passes through untouched to eager and SDPA attention."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, torch.finfo(dtype).min)[None, None]


def rotary(x: torch.Tensor, positions: torch.Tensor, rot_dim: int, theta: float) -> torch.Tensor:
    """Rotate the first ``rot_dim`` channels of ``x`` ``[B, H, T, hd]`` at
    ``positions`` ``[T]``; the rest pass through."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, device=x.device, dtype=torch.float32)
                               / rot_dim)                            # [rot/2]
    angles = positions.float()[:, None] * inv_freq                   # [T, rot/2]
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(x.dtype)          # [T, rot]
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(x.dtype)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    first, second = rot.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)
    return torch.cat([rot * cos + turned * sin, rest], dim=-1)


class TextBlock(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.ln = nn.LayerNorm(config.dim, eps=config.ln_eps)
        self.attn = FusedQKV(config.dim, config.n_heads)
        self.mlp = MLP(config.dim, config.ff_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        q, k, v = self.attn.heads(h)                                  # [B, H, T, hd]
        rot_dim = int(self.config.head_dim * self.config.rotary_fraction)
        q = rotary(q, positions, rot_dim, self.config.rope_theta)
        k = rotary(k, positions, rot_dim, self.config.rope_theta)
        attn = self.attn.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return x + attn + self.mlp(h)


class TextDecoder(nn.Module):
    """A whole-sequence forward (no KV cache): the reference the engine's
    paged paths are checked against, and a CPU fallback."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Parameter(torch.zeros(config.vocab_size, config.dim))
        self.blocks = nn.ModuleList(TextBlock(config) for _ in range(config.n_layers))
        self.post_ln = nn.LayerNorm(config.dim, eps=config.ln_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    def forward(self, embeds: torch.Tensor, prefix: int | None = None) -> torch.Tensor:
        """``[B, T, D]`` embeddings from position 0 -> hidden states
        ``[B, T, D]`` before the final norm (what the region decoders read).
        ``prefix`` defaults to the config's; 0 gives a plain causal model."""
        t = embeds.shape[1]
        positions = torch.arange(t, device=embeds.device)
        mask = prefix_mask(positions, t, self.config.prefix_attn if prefix is None else prefix)
        x = embeds
        for block in self.blocks:
            x = block(x, positions, mask)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.post_ln(hidden))


def phi_config(config: TextConfig, **overrides) -> PhiConfig:
    args = dict(vocab_size=config.vocab_size, hidden_size=config.dim,
                intermediate_size=config.ff_dim, num_hidden_layers=config.n_layers,
                num_attention_heads=config.n_heads, num_key_value_heads=config.n_heads,
                max_position_embeddings=config.max_context, layer_norm_eps=config.ln_eps,
                partial_rotary_factor=config.rotary_fraction, rope_theta=config.rope_theta,
                hidden_act="gelu_new", tie_word_embeddings=False, qk_layernorm=False)
    args.update(overrides)
    return PhiConfig(**args)


def phi_state_dict(text: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """moondream's text tensors (names relative to the text module) ->
    ``PhiForCausalLM`` names; the fused qkv splits into q, k, v."""
    out = {"model.embed_tokens.weight": text["wte"]}
    for part in ("weight", "bias"):
        out[f"model.final_layernorm.{part}"] = text[f"post_ln.{part}"]
        out[f"lm_head.{part}"] = text[f"lm_head.{part}"]
        for i in range(n_layers):
            src, dst = f"blocks.{i}", f"model.layers.{i}"
            out[f"{dst}.input_layernorm.{part}"] = text[f"{src}.ln.{part}"]
            q, k, v = text[f"{src}.attn.qkv.{part}"].chunk(3, dim=0)
            out[f"{dst}.self_attn.q_proj.{part}"] = q
            out[f"{dst}.self_attn.k_proj.{part}"] = k
            out[f"{dst}.self_attn.v_proj.{part}"] = v
            out[f"{dst}.self_attn.dense.{part}"] = text[f"{src}.attn.proj.{part}"]
            out[f"{dst}.mlp.fc1.{part}"] = text[f"{src}.mlp.fc1.{part}"]
            out[f"{dst}.mlp.fc2.{part}"] = text[f"{src}.mlp.fc2.{part}"]
    return out


def to_phi(decoder: TextDecoder, *, share: bool = False, **config_overrides) -> PhiForCausalLM:
    """A ``PhiForCausalLM`` with ``decoder``'s weights (eval mode): copies, or
    with ``share`` the decoder's own tensors (q, k and v views of its fused
    qkv), built without initializing weights it would then overwrite, so a
    real checkpoint is not held twice."""
    config = phi_config(decoder.config, **config_overrides)
    state = phi_state_dict({name: t.detach() for name, t in decoder.state_dict().items()},
                           decoder.config.n_layers)
    if not share:
        model = PhiForCausalLM(config)
        model.load_state_dict({name: t.clone() for name, t in state.items()}, strict=True)
        return model.to(decoder.wte.dtype).eval()
    with torch.device("meta"):
        model = PhiForCausalLM(config)
    model.load_state_dict(state, strict=True, assign=True)
    # The rotary tables are buffers the checkpoint does not hold: made anew.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(decoder.wte.device)
    left = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    left += [name for name, t in model.named_buffers() if t.is_meta]
    if left:
        raise RuntimeError(f"to_phi(share=True): tensors left unset: {left[:5]}")
    return model.eval()
