"""The decode step with fused projections, for the architectures that have one.

transformers' forward runs each projection of a layer as its own GEMM. At
decode batch sizes a GEMM is one pass over its weights plus a launch and a
tail, so the count of GEMMs, not their FLOPs, sets much of a step's time
(the H200 profile: ~6 GEMMs and ~15 small kernels per layer). Here:

- Phi (attention and MLP in parallel on one normed input): q, k, v and fc1
  are one GEMM; the attention's output projection and fc2 are one GEMM over
  ``[attention | act(fc1)]``, since their outputs are summed anyway.
  Two GEMMs per layer instead of six.
- Llama, Qwen2 (attention, then MLP): q, k, v are one GEMM; gate and up are
  one GEMM. Four instead of seven.

The fused weights are the model's own memory: each module's parameters are
re-pointed at views of the fused tensors, so nothing is stored twice and
transformers' forward (which prefill still uses) reads the same values.
Norms, activations and rotary embeddings are the model's own modules, so
numerics follow transformers; a fused GEMM sums in a different order, so
results agree to rounding, not bit for bit.

``make_decoder`` picks this path when the model is supported and says why
when it is not; every other decoder runs transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuda_backend.attention import CONTEXT_KWARG, PagedContext, decode_attention, write_kv

PARALLEL = ("phi",)
SEQUENTIAL = ("llama", "qwen2")
# Rope types whose frequencies depend on the sequence length recompute them
# from the positions on the host: no graph can hold that.
DYNAMIC_ROPE = ("dynamic", "longrope")


class TransformersDecoder:
    """The decode step as transformers' forward over the paged attention."""

    path = "transformers"

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: PagedContext) -> torch.Tensor:
        """``[B]`` tokens at ``[B]`` positions -> logits ``[B, V]``."""
        out = self.model(input_ids=input_ids.view(1, -1), position_ids=positions.view(1, -1),
                         use_cache=False, **{CONTEXT_KWARG: ctx})
        return out.logits[0]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the fused path, or None when it can."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in PARALLEL + SEQUENTIAL:
        return f"model type {kind!r} has no fused decode step"
    if model.training:
        return "the model is in training mode (dropout)"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return "no shared rotary embedding module"
    if any(d in str(getattr(rotary, "rope_type", "")) for d in DYNAMIC_ROPE):
        return f"rope type {rotary.rope_type!r} depends on the sequence length"
    return None


def make_decoder(model: nn.Module, fused: bool = True):
    """The fused decode step when asked for and supported, else transformers'.
    Returns ``(decoder, why_not_fused)``."""
    if model is None:  # a runner that only packs metadata (tests)
        return None, "no model"
    why = unsupported_reason(model) if fused else "not asked for"
    if why is not None:
        return TransformersDecoder(model), why
    return FusedDecoder(model), None


def _fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ``[sum N_i, K]`` (and bias) for linears sharing their input;
    each linear's parameters become row views of it."""
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused linears must all have a bias or none")
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start:start + n], requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:start + n], requires_grad=lin.bias.requires_grad)
        start += n
    return weight, bias


def _fuse_columns(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight ``[N, sum K_i]`` for linears whose outputs are summed: the
    GEMM over their concatenated inputs; each linear's weight becomes a column
    view of it. The bias is the sum of theirs (summed in float32)."""
    weight = torch.cat([lin.weight for lin in linears], dim=1)
    start = 0
    for lin in linears:
        k = lin.weight.shape[1]
        lin.weight = nn.Parameter(weight[:, start:start + k],
                                  requires_grad=lin.weight.requires_grad)
        start += k
    biases = [lin.bias.float() for lin in linears if lin.bias is not None]
    bias = torch.stack(biases).sum(0).to(weight.dtype) if biases else None
    return weight, bias


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding on the first ``cos.shape[-1]`` dims of
    ``x`` ``[B, heads, D]``; the rest pass through (partial rotary)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos + rotated * sin
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot


class _Attention:
    """What both layer kinds share: q/k/v from a fused output, rotary, the
    KV write and paged attention."""

    def __init__(self, attn: nn.Module, cfg, index: int):
        self.index = index
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.window = getattr(attn, "sliding_window", None)
        self.q_norm = getattr(attn, "q_layernorm", None) if getattr(attn, "qk_layernorm",
                                                                    False) else None
        self.k_norm = getattr(attn, "k_layernorm", None) if self.q_norm is not None else None
        self.sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim,
                      self.kv_heads * self.head_dim]

    def __call__(self, q, k, v, cos, sin, ctx: PagedContext) -> torch.Tensor:
        """Flat q/k/v ``[B, *]`` -> attention output ``[B, H * D]``."""
        b = q.shape[0]
        q = q.view(b, self.heads, self.head_dim)
        k = k.view(b, self.kv_heads, self.head_dim)
        v = v.view(b, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = write_kv(ctx, self.index, k, v)
        return decode_attention(q, keys, values, ctx, self.scaling, self.window).reshape(b, -1)


class _ParallelLayer:
    """Phi: ``x + dense(attn(ln(x))) + fc2(act(fc1(ln(x))))``."""

    def __init__(self, layer: nn.Module, cfg, index: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = _Attention(attn, cfg, index)
        self.norm, self.act = layer.input_layernorm, mlp.activation_fn
        self.w_in, self.b_in = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj, mlp.fc1])
        self.w_out, self.b_out = _fuse_columns([attn.dense, mlp.fc2])
        self.sizes = self.attn.sizes + [mlp.fc1.weight.shape[0]]

    def __call__(self, x, cos, sin, ctx):
        y = F.linear(self.norm(x), self.w_in, self.b_in)
        q, k, v, f = y.split(self.sizes, dim=-1)
        a = self.attn(q, k, v, cos, sin, ctx)
        return x + F.linear(torch.cat((a, self.act(f)), dim=-1), self.w_out, self.b_out)


class _SequentialLayer:
    """Llama, Qwen2: ``h = x + o(attn(n1(x)))``, ``h + down(act(gate) * up)``."""

    def __init__(self, layer: nn.Module, cfg, index: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = _Attention(attn, cfg, index)
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.o_proj, self.down, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.w_qkv, self.b_qkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        self.w_gu, self.b_gu = _fuse_rows([mlp.gate_proj, mlp.up_proj])
        self.inter = mlp.gate_proj.weight.shape[0]

    def __call__(self, x, cos, sin, ctx):
        q, k, v = F.linear(self.norm1(x), self.w_qkv, self.b_qkv).split(self.attn.sizes, dim=-1)
        x = x + self.o_proj(self.attn(q, k, v, cos, sin, ctx))
        gate, up = F.linear(self.norm2(x), self.w_gu, self.b_gu).split(self.inter, dim=-1)
        return x + self.down(self.act(gate) * up)


class FusedDecoder:
    """The decode step of a supported model with fused projections."""

    def __init__(self, model: nn.Module):
        cfg, body = model.config, model.model
        kind = _ParallelLayer if cfg.model_type in PARALLEL else _SequentialLayer
        self.path = f"fused {cfg.model_type}"
        self.embed, self.rotary, self.lm_head = body.embed_tokens, body.rotary_emb, model.lm_head
        self.norm = body.final_layernorm if cfg.model_type in PARALLEL else body.norm
        with torch.no_grad():
            self.layers = [kind(layer, cfg, i) for i, layer in enumerate(body.layers)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: PagedContext) -> torch.Tensor:
        """``[B]`` tokens at ``[B]`` positions -> logits ``[B, V]``."""
        x = self.embed(input_ids)  # [B, hidden]
        cos, sin = self.rotary(x, positions.view(1, -1))  # [1, B, rot] each, in x's dtype
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [B, 1, rot]: over heads
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.lm_head(self.norm(x))
