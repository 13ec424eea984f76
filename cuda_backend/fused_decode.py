"""The decode step with fused projections, for the architectures that have one.

transformers' forward runs each projection of a layer as its own GEMM, and
at decode batch sizes the count of GEMMs, not their FLOPs, sets much of a
step's time (the H200 profile: ~6 GEMMs and ~15 small kernels per layer).
``FusedDecoder`` runs a supported model's decode step over fused weights
instead (``fused_layers``: two GEMMs a layer for Phi, four for Llama and
Qwen2), then the head; norms and the rotary tables are the model's own
modules. In a decode step on CUDA the rotary embedding itself, the KV
write and (Phi) the MLP's activation run inside the attention kernels
(``rope_attention``), in float32, where the backend's ``KernelConfig``
says so; a prefill on CUDA runs them as one kernel before it attends
(``rope_store``), and other devices apply them with torch. A fused GEMM
sums in a different order too, so results agree with transformers to
rounding, not bit for bit.

``make_decoder`` picks this path when the model is supported and says why
when it is not; every other decoder runs transformers' forward.
"""

from __future__ import annotations

import types

import attrs
import torch
from torch import nn

from bubblefree.cuda_backend import normed_gemv, pdl_step, skinny_gemm
from bubblefree.cuda_backend.attention import CONTEXT_KWARG, PagedContext
from bubblefree.cuda_backend.fused_layers import (Dims, parallel_layer, parallel_weights,
                                                  sequential_layer, sequential_weights)
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.pdl import supported as pdl_supported
from bubblefree.cuda_backend.rope_attention import ACTIVATIONS
from bubblefree.cuda_backend.step_inputs import RopeTable

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

    def compiled(self, on: bool):
        return torch.compile(self) if on else self


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
    for layer in model.model.layers:
        norm, attn, mlp = layer.input_layernorm, layer.self_attn, layer.mlp
        if kind in PARALLEL and not isinstance(norm, nn.LayerNorm):
            return f"a {type(norm).__name__} where a LayerNorm was expected"
        if kind in SEQUENTIAL and not hasattr(norm, "variance_epsilon"):
            return f"a {type(norm).__name__} where an RMSNorm was expected"
        groups = [[attn.q_proj, attn.k_proj, attn.v_proj]
                  + ([mlp.fc1] if kind in PARALLEL else []),
                  [] if kind in PARALLEL else [mlp.gate_proj, mlp.up_proj]]
        for group in groups:
            if len({lin.bias is None for lin in group}) > 1:
                return "projections fused into one GEMM differ in having a bias"
    return None


def make_decoder(model: nn.Module, kernels: KernelConfig, fused: bool = True):
    """The fused decode step when asked for and supported, else transformers'.
    Returns ``(decoder, why_not_fused)``."""
    if model is None:  # a runner that only packs metadata (tests)
        return None, "no model"
    why = unsupported_reason(model) if fused else "not asked for"
    if why is not None:
        return TransformersDecoder(model), why
    return FusedDecoder(model, kernels), None


def _own_copy(fn):
    """``fn`` with its own code object. torch.compile keeps compiled code per
    code object; without a copy every model in the process would share (and
    de-specialise, and exhaust the recompile limit of) one cache."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


class FusedDecoder:
    """The decode step of a supported model: embedding and rotary tables,
    then one layer function per layer over fused weights, then the head.
    ``compiled(True)`` compiles the layer function: every layer has the same
    shapes, so one compilation serves them all (a compile of the whole
    unrolled model takes minutes for a 24-layer decoder)."""

    def __init__(self, model: nn.Module, kernels: KernelConfig):
        cfg, body = model.config, model.model
        parallel = cfg.model_type in PARALLEL
        self.path = f"fused {cfg.model_type}"
        self.embed, self.rotary, self.lm_head = body.embed_tokens, body.rotary_emb, model.lm_head
        self.norm = body.final_layernorm if parallel else body.norm
        first = body.layers[0]
        attn = first.self_attn
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        if parallel:
            eps, inter = first.input_layernorm.eps, first.mlp.fc1.weight.shape[0]
            self.act = first.mlp.activation_fn
        else:
            eps, inter = first.input_layernorm.variance_epsilon, first.mlp.gate_proj.weight.shape[0]
            self.act = first.mlp.act_fn
        qkv = (heads * attn.head_dim, kv_heads * attn.head_dim, kv_heads * attn.head_dim)
        self.windows = [getattr(layer.self_attn, "sliding_window", None) for layer in body.layers]
        self.layer_fn = parallel_layer if parallel else sequential_layer
        with torch.no_grad():
            make = parallel_weights if parallel else sequential_weights
            self.weights = [make(layer) for layer in body.layers]
        self.step_layer = self.layer_fn
        # One op for rotary, the KV write and attention, or three steps; and
        # Phi's MLP activation in that op, when it is one the kernels know.
        self.rope_in_kernel = kernels.new_token
        act = ACTIVATIONS.get(getattr(cfg, "hidden_act", None), 0)
        act = act if parallel and kernels.mlp_act else 0
        device = self.lm_head.weight.device
        pdl_rows = kernels.pdl_rows if kernels.new_token and pdl_supported(device) else 0
        sms = torch.cuda.get_device_properties(device).multi_processor_count if pdl_rows else 132
        counters, combine_rows = None, min(pdl_rows, kernels.last_combines)
        if combine_rows:
            counters = torch.zeros(combine_rows * heads, dtype=torch.int32, device=device)
        self.dims = Dims(heads=heads, kv_heads=kv_heads, head_dim=attn.head_dim, eps=eps,
                         scaling=attn.scaling, split=qkv + ((inter,) if parallel else ()),
                         inter=inter, act=act, tiles=kernels.tiles,
                         one_store=kernels.prefill_store, pdl_rows=pdl_rows,
                         pdl_tiles=kernels.pdl_tiles, sms=sms,
                         glu=not parallel and getattr(cfg, "hidden_act", None) == "silu",
                         counters=counters, combine_rows=combine_rows,
                         state_rows=0 if parallel else min(pdl_rows, kernels.o_combines),
                         early_rows=min(pdl_rows, kernels.early_norms),
                         early_attention_rows=min(pdl_rows, kernels.early_attention))
        chained = min(pdl_rows, kernels.norms_in)
        # The layers without norm kernels hold 16-bit weights in registers,
        # as many a thread as fit: where they cannot, the layers keep them.
        if chained and self.dims.glu and self.lm_head.weight.dtype in normed_gemv.DTYPES \
                and pdl_step.chainable(self.weights[0], self.dims, chained):
            self.dims = attrs.evolve(self.dims, norms_in_rows=chained)
        self.pdl_layer = pdl_step.parallel_layer if parallel else pdl_step.sequential_layer
        # What the first dependent layer adds to the embeddings: nothing,
        # from one buffer rather than a fill kernel each step.
        self.zero_delta = torch.zeros(1, pdl_rows, cfg.hidden_size, dtype=torch.float32,
                                      device=device) if pdl_rows else None
        # Gathered rotary rows and embeddings (step_inputs), where the
        # embedding is a plain lookup: ``rope_table`` builds the table.
        self.gathers_inputs = kernels.step_inputs and type(self.embed) is nn.Embedding
        self.rope: RopeTable | None = None
        # The final norm, as add_norm takes it: weight, bias, eps, RMS or not.
        self.final_norm = ((self.norm.weight, self.norm.bias, self.norm.eps, False) if parallel
                           else (self.norm.weight, None, self.norm.variance_epsilon, True))
        if pdl_rows:
            self.path += f", dependent launches up to {pdl_rows} rows"

    def compiled(self, on: bool) -> "FusedDecoder":
        self.step_layer = torch.compile(_own_copy(self.layer_fn)) if on else self.layer_fn
        return self

    def rope_table(self, positions: int) -> RopeTable | None:
        """The rotary values of positions ``0 .. positions - 1``, computed
        once by the model's module (None where inputs are not gathered)."""
        if self.gathers_inputs and (self.rope is None or len(self.rope) < positions):
            weight = self.embed.weight
            self.rope = RopeTable.of(self.rotary, positions, weight.dtype, weight.device)
        return self.rope if self.gathers_inputs else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext,
                 last: torch.Tensor | None = None) -> torch.Tensor:
        """``[B]`` tokens at ``[B]`` positions -> logits ``[B, V]``, or only
        the rows ``last`` ``[R]`` -> ``[R, V]`` (a prefill's last tokens)."""
        x = self.embed(input_ids)
        if last is None:
            return self.decode_step(x, positions, ctx)[1]
        return self.head(self.hidden(x, positions, ctx).index_select(0, last))

    def decode_step(self, x: torch.Tensor, positions: torch.Tensor, ctx: PagedContext,
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step over input embeddings ``[B, D]``: the last layer's
        output before the final norm ``[B, D]`` and the logits ``[B, V]``.
        ``rope``: the rows' cos and sin ``[B, rot]`` where already gathered."""
        # The one op lets each row see the cache as it was before the
        # step, plus its own key. Right for a decode step (a row per
        # sequence); the token rows of a prefill must see each other's
        # keys, so they write first and attend after (three steps).
        h, normed = self.hidden_normed(x, positions, ctx, one_op=self.rope_in_kernel, rope=rope)
        return h, self.logits(normed, pdl=self.uses_pdl(x.shape[0], self.rope_in_kernel))

    def uses_pdl(self, rows: int, one_op: bool) -> bool:
        """Whether a decode step over ``rows`` rows runs ``pdl_step``'s layers."""
        return one_op and rows <= self.dims.pdl_rows

    def _layers(self, x, positions, ctx, one_op: bool, compiled: bool, rope=None):
        """The layers over input embeddings: ``(x, delta, pdl)``, the output
        being ``x + delta`` (``delta`` as sums where ``pdl``)."""
        if rope is None:
            cos, sin = self.rotary(x, positions.view(1, -1))  # [1, T, rot] each, in x's dtype
            cos, sin = cos[0], sin[0]
        else:
            cos, sin = rope
        pdl = self.uses_pdl(x.shape[0], one_op)
        if pdl:
            zero = self.zero_delta
            if zero is None or zero.shape[1] < x.shape[0]:  # more rows than measured for
                zero = x.new_zeros((1, *x.shape), dtype=torch.float32)
            layer, delta = self.pdl_layer, zero[:, :x.shape[0]]
            if x.shape[0] <= self.dims.norms_in_rows:  # delta stays zero through these
                layer = pdl_step.chained_layer
        else:
            layer, delta = self.step_layer if compiled else self.layer_fn, torch.zeros_like(x)
        for i, w in enumerate(self.weights):
            kv = ctx.cache.layer_kv(i) if one_op else ctx.cache.layer(i)
            x, delta = layer(x, delta, cos, sin, kv, ctx, w, self.dims, self.act, self.windows[i])
        return x, delta, pdl

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, ctx: PagedContext, *,
               one_op: bool = False, compiled: bool = True) -> torch.Tensor:
        """Input embeddings ``[T, hidden]`` at ``[T]`` positions -> the last
        layer's output before the final norm ``[T, hidden]`` (what a region
        head reads). ``ctx`` is a decode context (a row per token) or a
        packed prefill's (``attention.prefill_context``); ``one_op`` only
        for the former. ``compiled=False`` runs the plain layer function
        (a prefill's shapes change every step: no compile per shape)."""
        x, delta, pdl = self._layers(x, positions, ctx, one_op, compiled)
        return pdl_step.combine(x, delta) if pdl else x + delta

    def hidden_normed(self, x: torch.Tensor, positions: torch.Tensor, ctx: PagedContext, *,
                      one_op: bool = False, rope=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``'s output and its final norm, the head's input (one
        kernel for both where the step runs ``pdl_step``'s layers)."""
        x, delta, pdl = self._layers(x, positions, ctx, one_op, True, rope)
        if pdl:
            return pdl_step.final(x, delta, *self.final_norm,
                                  early=x.shape[0] <= self.dims.early_rows)
        h = x + delta
        return h, self.norm(h)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[R, hidden]`` before the final norm -> logits ``[R, V]``."""
        return self.logits(self.norm(x))

    def logits(self, normed: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """Normed hidden states ``[R, hidden]`` -> logits ``[R, V]``."""
        if pdl:
            return pdl_step.gemm(normed, self.lm_head.weight, self.lm_head.bias, self.dims)
        return skinny_gemm.linear(normed, self.lm_head.weight, self.lm_head.bias, self.dims.tiles)
