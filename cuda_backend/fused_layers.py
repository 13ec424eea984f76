"""A fused decoder's layers: the fused weights, and one layer's step.

transformers' forward runs each projection of a layer as its own GEMM. At
decode batch sizes a GEMM is one pass over its weights plus a launch and a
tail, so the count of GEMMs, not their FLOPs, sets much of a step's time.
Here:

- Phi (attention and MLP in parallel on one normed input): q, k, v and fc1
  are one GEMM; the attention's output projection and fc2 are one GEMM over
  ``[attention | act(fc1)]``, since their outputs are summed anyway.
  Two GEMMs per layer instead of six.
- Llama, Qwen2 (attention, then MLP): q, k, v are one GEMM; gate and up are
  one GEMM. Four instead of seven.

The fused weights are the model's own memory (``parallel_weights``,
``sequential_weights``): each module's parameters are re-pointed at views
of the fused tensors, so nothing is stored twice and transformers' forward
(which prefill still uses) reads the same values. ``Dims`` holds a model's
constants, the same at every layer. ``fused_decode.FusedDecoder`` runs the
layers; with dependent launches, ``pdl_step``'s layers replace these.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from bubblefree.cuda_backend import skinny_gemm
from bubblefree.cuda_backend.add_norm import rms_norm
from bubblefree.cuda_backend.attention import decode_attention, prefill_attention, store_kv
from bubblefree.cuda_backend.kernel_config import TileTable
from bubblefree.cuda_backend.rope_attention import rope_attend, rotate
from bubblefree.cuda_backend.rope_store import available as rope_store_available
from bubblefree.cuda_backend.rope_store import rope_store


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


@attrs.frozen
class Dims:
    """A model's constants, one instance shared by all its layers, so the
    compiled layer function sees the same constants at every layer."""
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    split: tuple[int, ...]  # sizes of the fused input GEMM's outputs
    inter: int  # MLP width
    # Phi: its MLP activation (rope_attention.ACTIVATIONS) applied by the
    # attention op, 0 for a kernel of its own.
    act: int = 0
    # The layers' GEMMs: cuBLAS, or our decode-sized kernel for the weight
    # shapes and row counts where the table has a tile (skinny_gemm).
    tiles: TileTable = TileTable()
    # A prefill's rotary, KV write and activation as one kernel (rope_store).
    one_store: bool = False
    # Decode buckets of at most this many rows run pdl_step's layers (0:
    # none); the GPU's multiprocessors, which its GEMM tiles cover; whether
    # the MLP is silu(gate) * up, which its gate and up GEMM then writes.
    pdl_rows: int = 0
    pdl_tiles: TileTable = TileTable()
    sms: int = 132
    glu: bool = False
    # In pdl_step's buckets of at most ``combine_rows`` rows, the split
    # attention kernel's last programs combine (KernelConfig.last_combines):
    # its arrival counters, one per (row, head), zero between launches (each
    # launch leaves them so).
    counters: torch.Tensor | None = attrs.field(default=None, eq=False)
    combine_rows: int = 0
    # In pdl_step's buckets of at most ``state_rows`` rows where the split
    # kernel runs, the output projection combines its states
    # (KernelConfig.o_combines; sequential layers only).
    state_rows: int = 0
    # In pdl_step's buckets of at most ``early_rows`` rows, the norms let the
    # next kernel launch before they wait (KernelConfig.early_norms).
    early_rows: int = 0
    # In those buckets whose output projection combines the split kernel's
    # states, the split kernel lets it launch before it waits
    # (KernelConfig.early_attention).
    early_attention_rows: int = 0
    # Buckets of at most this many rows run Llama's and Qwen2's layers
    # without norm kernels (pdl_step.chained_layer; KernelConfig.norms_in).
    norms_in_rows: int = 0


# The layers' GEMMs: cuBLAS, or our decode-sized kernel where ``Dims.tiles``
# has a tile for the weight's shape and row count.
_linear = skinny_gemm.linear


def _attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims: Dims, window, mlp=None):
    """Flat q/k/v ``[B, *]`` -> attention output ``[B, H * D]``: rotary, the
    KV write, paged attention. ``kv`` is the layer's whole cache tensor (one
    op does all three: ``rope_attention``) or its ``(keys, values)`` views
    (a prefill's keys are written before any row attends: ``rope_store``,
    or torch's steps, then attention). With ``mlp`` (the one op or
    ``rope_store`` only) the output is ``[B, H * D + I]``: the attention,
    then ``dims.act`` of ``mlp`` ``[B, I]``."""
    b = q.shape[0]
    q = q.view(b, dims.heads, dims.head_dim)
    k = k.view(b, dims.kv_heads, dims.head_dim)
    v = v.view(b, dims.kv_heads, dims.head_dim)
    if qk_norm is not None:  # Phi's optional per-head LayerNorms
        q = F.layer_norm(q, (dims.head_dim,), qk_norm[0], qk_norm[1], dims.eps)
        k = F.layer_norm(k, (dims.head_dim,), qk_norm[2], qk_norm[3], dims.eps)
    if isinstance(kv, torch.Tensor):  # a decode step's one op
        out = rope_attend(q, k, v, cos, sin, kv, ctx.slot_mapping, ctx.page_table,
                          ctx.q_pos[:, 0], ctx.cache.page_size, dims.scaling, window, mlp,
                          dims.act, dispatch=ctx.dispatch)
        return out if mlp is not None else out.reshape(b, -1)
    keys, values = kv
    row = None
    if store_in_one_kernel(q, dims):  # rotary, the KV write (and the activation): one launch
        if mlp is not None:
            row = q.new_empty((b, dims.heads * dims.head_dim + mlp.shape[1]))
        q = rope_store(q, k, v, cos, sin, keys, values, ctx.slot_mapping, mlp,
                       None if row is None else row[:, dims.heads * dims.head_dim:],
                       dims.act if mlp is not None else 0)
    else:
        if mlp is not None:
            raise ValueError("_attend: an mlp rider needs the one op or rope_store")
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over heads
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        store_kv(keys, values, ctx.slot_mapping, k, v)
    if not ctx.is_decode:  # a packed prefill: each row's queries over its pages
        out = prefill_attention(q, keys, values, window, dims.scaling, ctx).reshape(b, -1)
    else:
        out = decode_attention(q, keys, values, ctx, dims.scaling, window).reshape(b, -1)
    if row is None:
        return out
    row[:, :out.shape[1]].copy_(out)
    return row


def store_in_one_kernel(q: torch.Tensor, dims: Dims) -> bool:
    """Whether a layer that writes its keys before attending (a prefill)
    runs ``rope_store``: where the kernels say so, on CUDA with Triton,
    outside torch.compile (which traces the torch steps and fuses them)."""
    return dims.one_store and rope_store_available(q) and not torch.compiler.is_compiling()


def parallel_layer(x, delta, cos, sin, kv, ctx, w, dims: Dims, act, window):
    """Phi. The residual stream arrives as ``x + delta`` (the previous layer's
    output not yet added, so the add fuses with this layer's norm); returns
    the new ``(x, delta)``. The output GEMM reads ``[attention | act(fc1)]``:
    with the one attention op and an activation it knows, the op writes that
    whole row (no kernel of its own for the activation and the concat)."""
    norm_w, norm_b, w_in, b_in, w_out, b_out, qk_norm = w
    x = x + delta
    h = F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, dims.eps)
    q, k, v, f = _linear(h, w_in, b_in, dims.tiles).split(dims.split, dim=-1)
    if dims.act and (isinstance(kv, torch.Tensor) or store_in_one_kernel(q, dims)):
        return x, _linear(_attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims, window, f),
                          w_out, b_out, dims.tiles)
    a = _attend(q, k, v, cos, sin, kv, ctx, qk_norm, dims, window)
    return x, _linear(torch.cat((a, act(f)), dim=-1), w_out, b_out, dims.tiles)


def sequential_layer(x, delta, cos, sin, kv, ctx, w, dims: Dims, act, window):
    """Llama, Qwen2; the residual stream as in ``parallel_layer``."""
    norm1, w_qkv, b_qkv, w_o, b_o, norm2, w_gu, b_gu, w_down, b_down = w
    x = x + delta
    norm = rms_norm(x, norm1, dims.eps)
    q, k, v = _linear(norm, w_qkv, b_qkv, dims.tiles).split(dims.split, dim=-1)
    x = x + _linear(_attend(q, k, v, cos, sin, kv, ctx, None, dims, window), w_o, b_o,
                    dims.tiles)
    norm = rms_norm(x, norm2, dims.eps)
    gate, up = _linear(norm, w_gu, b_gu, dims.tiles).split(dims.inter, dim=-1)
    return x, _linear(act(gate) * up, w_down, b_down, dims.tiles)


def parallel_weights(layer: nn.Module):
    attn, mlp = layer.self_attn, layer.mlp
    w_in, b_in = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj, mlp.fc1])
    w_out, b_out = _fuse_columns([attn.dense, mlp.fc2])
    qk = None
    if getattr(attn, "qk_layernorm", False):
        qk = (attn.q_layernorm.weight, attn.q_layernorm.bias,
              attn.k_layernorm.weight, attn.k_layernorm.bias)
    norm = layer.input_layernorm
    return (norm.weight, norm.bias, w_in, b_in, w_out, b_out, qk)


def sequential_weights(layer: nn.Module):
    attn, mlp = layer.self_attn, layer.mlp
    w_qkv, b_qkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    w_gu, b_gu = _fuse_rows([mlp.gate_proj, mlp.up_proj])
    return (layer.input_layernorm.weight, w_qkv, b_qkv, attn.o_proj.weight, attn.o_proj.bias,
            layer.post_attention_layernorm.weight, w_gu, b_gu, mlp.down_proj.weight,
            mlp.down_proj.bias)
