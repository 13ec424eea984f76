"""Paged attention, plugged into transformers through its AttentionInterface.

transformers owns the architecture (projections, rotary, norms, MLP); this
function owns what happens between the projected q/k/v and the attention
output: new keys and values are written into the engine's pages, and each
row attends over its own pages. transformers' attention registry is global,
so one stateless function is registered once under ``ATTN_IMPLEMENTATION``;
everything per step (page tables, positions, where to write) travels as a
``PagedContext`` in the forward's keyword arguments, which transformers hands
to every attention call unchanged. No module-global mutable state.

The model always sees a packed batch ``[1, T]``: decode steps put one token
per row; prefill steps concatenate the rows' prompts. Inside, queries are
laid out per row ``[R, S]`` (S = 1 for decode) against keys gathered from the
pages ``[R, L]``; a boolean mask ``[R, S, L]`` keeps each query causal within
its own row (key position <= query position), which is what makes a packed
prefill of rows of different lengths correct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from bubblefree.cuda_backend import paged_decode
from bubblefree.cuda_backend.kernel_config import Dispatch
from bubblefree.cuda_backend.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "bubblefree_paged"
CONTEXT_KWARG = "paged_context"


class PagedContext:
    """Per-forward attention metadata, all device tensors built before the
    forward (inside the captured graph for decode steps), and for decode
    steps the backend's attention ``dispatch`` (which paged kernel runs)."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, page_table: torch.Tensor,
                 q_pos: torch.Tensor, q_gather: torch.Tensor | None = None,
                 out_gather: torch.Tensor | None = None, group_rows: int | None = None,
                 gather_keys: bool = True, dispatch: Dispatch | None = None,
                 prefix_end: torch.Tensor | None = None):
        rows = page_table.shape[0]
        self.cache = cache
        self.dispatch = dispatch
        self.page_table = page_table  # [R, P]
        self.slot_mapping = slot_mapping  # [T] flat KV index each new token is written to
        self.q_pos = q_pos  # [R, S] absolute position of each (padded) query
        if gather_keys:  # the paged kernel reads pages in place and needs neither
            self.kv_index, self.key_pos = row_keys(page_table, cache.page_size)
        self.q_gather = q_gather  # [R * S] packed token of each padded query (prefill)
        self.out_gather = out_gather  # [T] padded query of each packed token (prefill)
        # [R] (prefill only, optional): positions below a row's prefix_end
        # attend to each other both ways (an image prefix); later ones are causal.
        self.prefix_end = prefix_end
        # Prefill attends in groups of rows so the gathered keys of a group
        # (rows * L) stay bounded however long one row's context is.
        g = group_rows or rows
        self.row_groups = [(r, min(r + g, rows)) for r in range(0, rows, g)]
        self._masks: dict[int | None, torch.Tensor] = {}

    @property
    def is_decode(self) -> bool:
        return self.q_gather is None

    def mask(self, window: int | None, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """``[r1 - r0, S, L]`` bool, True where a query may attend a key: causal
        within its row (so never past its own context), and inside the sliding
        window if the layer has one (transformers' rule: q - k < window). With
        ``prefix_end``, a query inside its row's prefix also sees every key of
        the prefix (bidirectional; moondream's ``text.prefix_mask``).
        Whole-batch masks (decode) are built once per window size per forward
        and shared by all layers; a prefill group's mask is built per layer,
        which keeps it bounded (``row_groups``)."""
        whole = r0 == 0 and r1 is None
        if whole and window in self._masks:
            return self._masks[window]
        q = self.q_pos[r0:r1].unsqueeze(-1)  # [g, S, 1]
        m = self.key_pos <= q  # [g, S, L]
        if window is not None:
            m = m & (self.key_pos > q - window)
        if self.prefix_end is not None:
            end = self.prefix_end[r0:r1].view(-1, 1, 1)  # [g, 1, 1]
            m = m | ((q < end) & (self.key_pos < end))
        if whole:
            self._masks[window] = m
        return m


def row_keys(page_table: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, L]`` flat KV index of key position j of row r (L = pages *
    page_size), and the key positions ``[L]``."""
    rows, pages = page_table.shape
    offsets = torch.arange(page_size, device=page_table.device)
    kv_index = (page_table.unsqueeze(-1) * page_size + offsets).view(rows, pages * page_size)
    return kv_index, torch.arange(pages * page_size, device=page_table.device)


def decode_context(cache: PagedKVCache, positions: torch.Tensor, page_table: torch.Tensor,
                   dispatch: Dispatch, slot_mapping: torch.Tensor | None = None) -> PagedContext:
    """One input token per row at ``positions`` ``[B]``; ``page_table`` ``[B, P]``;
    ``dispatch`` picks the paged kernel where it runs. ``slot_mapping``:
    each row's KV slot where already computed (``step_inputs``)."""
    if slot_mapping is None:
        ps = cache.page_size
        page = page_table.gather(1, (positions // ps).unsqueeze(1)).squeeze(1)  # [B]
        slot_mapping = page * ps + positions % ps
    return PagedContext(cache, slot_mapping, page_table, positions.unsqueeze(1),
                        gather_keys=not paged_decode.available(page_table), dispatch=dispatch)


def prefill_context(cache: PagedKVCache, slot_mapping: torch.Tensor, page_table: torch.Tensor,
                    q_start: torch.Tensor, q_len: torch.Tensor, pos0: torch.Tensor,
                    out_gather: torch.Tensor, max_q: int, key_budget: int,
                    prefix_end: torch.Tensor | None = None) -> PagedContext:
    """Packed rows: row r's tokens are ``q_start[r] .. + q_len[r]`` of the
    packed batch, at positions ``pos0[r] ..``; ``max_q`` is the longest row;
    at most ``key_budget`` keys (rows * L) are gathered at once. Positions
    below ``prefix_end[r]`` ``[R]``, when given, attend both ways among
    themselves."""
    s = torch.arange(max_q, device=q_start.device)  # [S]
    valid = s < q_len.unsqueeze(1)  # [R, S]
    q_gather = torch.where(valid, q_start.unsqueeze(1) + s, 0).view(-1)  # [R * S]
    # Padded queries sit at position 0: they see key 0 only (never an empty
    # softmax row) and their outputs are dropped by ``out_gather``.
    q_pos = torch.where(valid, pos0.unsqueeze(1) + s, 0)  # [R, S]
    length = page_table.shape[1] * cache.page_size
    return PagedContext(cache, slot_mapping, page_table, q_pos, q_gather, out_gather,
                        group_rows=max(1, key_budget // length), prefix_end=prefix_end)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention signature: query ``[1, H, T, D]``, key/value
    ``[1, KVH, T, D]``; returns ``([1, T, H, Dv], None)``."""
    ctx: PagedContext | None = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise RuntimeError(f"attention '{ATTN_IMPLEMENTATION}' needs a PagedContext in "
                           f"'{CONTEXT_KWARG}'; run the model through CudaBackend")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"paged attention: '{name}' is not supported")
    keys, values = write_kv(ctx, module.layer_idx, key[0].transpose(0, 1),
                            value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)  # [T, H, D]
    window = kwargs.get("sliding_window")
    if ctx.is_decode:
        out = decode_attention(q, keys, values, ctx, scaling, window)
    else:
        out = prefill_attention(q, keys, values, window, scaling, ctx)
    return out.unsqueeze(0), None


def write_kv(ctx: PagedContext, layer: int, key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's new keys and values ``[T, KVH, D]`` at
    ``ctx.slot_mapping``; returns the layer's whole ``[N * ps, KVH, D]`` pair."""
    keys, values = ctx.cache.layer(layer)
    store_kv(keys, values, ctx.slot_mapping, key, value)
    return keys, values


def store_kv(keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor) -> None:
    """``keys[slot_mapping] = key`` (and values), in the cache's dtype."""
    keys.index_copy_(0, slot_mapping, key.to(keys.dtype))
    values.index_copy_(0, slot_mapping, value.to(values.dtype))


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     ctx: PagedContext, scaling: float | None,
                     window: int | None) -> torch.Tensor:
    """One query per row ``[B, H, D]`` over its own pages: the Triton kernel
    ``ctx.dispatch`` picks on CUDA, the gathering path elsewhere. Returns
    ``[B, H, Dv]``."""
    if paged_decode.available(q):
        return paged_decode.paged_decode_attention(q, keys, values, ctx.page_table,
                                                   ctx.q_pos[:, 0], ctx.cache.page_size,
                                                   scaling, window, dispatch=ctx.dispatch)
    k, v = _gather(keys, values, ctx.kv_index, q.dtype)
    return _decode_attention(q, k, v, ctx.mask(window)[:, 0], scaling)


def _gather(keys: torch.Tensor, values: torch.Tensor, kv_index: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``kv_index`` ``[R, L]``: ``[R, L, KVH, D]`` each."""
    rows, length = kv_index.shape
    flat = kv_index.reshape(-1)
    k = keys.index_select(0, flat).view(rows, length, *keys.shape[1:])
    v = values.index_select(0, flat).view(rows, length, *values.shape[1:])
    return k.to(dtype), v.to(dtype)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scaling: float | None) -> torch.Tensor:
    """One query per row. Grouped-query heads are matched by reshaping the
    queries ``[B, KVH, G, D]`` rather than repeating keys, so a decode step
    reads each gathered key once. Mirrors transformers' eager attention:
    scores in the model dtype, softmax in float32."""
    b, h, d = q.shape
    kvh = k.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    qg = q.reshape(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # [B, KVH, G, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [B, KVH, G, Dv]
    return out.reshape(b, h, -1)  # [B, H, Dv]


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       window: int | None, scaling: float | None,
                       ctx: PagedContext) -> torch.Tensor:
    """Queries padded per row ``[R, H, S, D]``; one SDPA call per row group."""
    rows, s = ctx.q_pos.shape
    h = q.shape[1]
    outs = []
    for r0, r1 in ctx.row_groups:
        k, v = _gather(keys, values, ctx.kv_index[r0:r1], q.dtype)  # [g, L, KVH, D]
        groups = h // k.shape[2]
        qp = q.index_select(0, ctx.q_gather[r0 * s:r1 * s]).view(r1 - r0, s, h, -1)
        kr, vr = _repeat_heads(k, groups), _repeat_heads(v, groups)  # [g, H, L, D] each
        mask = ctx.mask(window) if len(ctx.row_groups) == 1 else ctx.mask(window, r0, r1)
        out = F.scaled_dot_product_attention(qp.transpose(1, 2), kr, vr,
                                             attn_mask=mask.unsqueeze(1), scale=scaling)
        outs.append(out.transpose(1, 2).reshape((r1 - r0) * s, h, -1))  # [g * S, H, Dv]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [R * S, H, Dv]
    return out.index_select(0, ctx.out_gather)  # [T, H, Dv]


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[g, L, KVH, D]`` -> ``[g, KVH * groups, L, D]``, each KV head repeated
    for its query heads (``repeat_interleave``'s order). By expand and
    reshape: the same copy, with no device-side repeat count that a CUDA
    graph capture could trip on."""
    g, length, kvh, d = x.shape
    x = x.permute(0, 2, 1, 3)  # [g, KVH, L, D]
    if groups == 1:
        return x
    return x.unsqueeze(2).expand(g, kvh, groups, length, d).reshape(g, kvh * groups, length, d)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
