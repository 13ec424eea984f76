"""The paged KV cache: one tensor the engine owns, attention reads and writes.

Layout ``[layers, 2, num_pages + 1, page_size, kv_heads, head_dim]``. The last
page is a scratch page that belongs to no sequence: padded rows of a captured
decode graph write their keys there and read (masked-out) keys from it, so a
padded row never touches a real sequence's pages. The core's allocator only
ever hands out pages ``0 .. num_pages - 1`` (``Capacity.num_pages``).

No sequence reserves a maximum length: a sequence owns exactly the pages the
core gave it, and the KV of position ``p`` lives in ``pages[p // page_size]``
at offset ``p % page_size``.
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.errors import CacheTooSmall


def page_bytes(layers: int, kv_heads: int, head_dim: int, page_size: int,
               dtype: torch.dtype) -> int:
    """Bytes one page occupies across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * page_size * kv_heads * head_dim * itemsize


def pages_that_fit(budget_bytes: int, bytes_per_page: int) -> int:
    """How many pages (plus the scratch page) fit in ``budget_bytes``; raises
    ``CacheTooSmall`` when not even one does."""
    n = budget_bytes // bytes_per_page - 1  # one page is the scratch page
    if n < 1:
        raise CacheTooSmall(
            f"KV cache: {max(budget_bytes, 0) / 2**20:.1f} MiB free for the cache, but one page "
            f"needs {bytes_per_page / 2**20:.3f} MiB (and one more for the scratch page); "
            f"free device memory, lower page_size, or raise kv_memory_fraction")
    return n


class PagedKVCache:
    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int, dtype: torch.dtype, device: torch.device):
        if num_pages < 1:
            raise CacheTooSmall(f"KV cache: num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise CacheTooSmall(f"KV cache: page_size must be >= 1, got {page_size}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_page = num_pages
        try:
            # [L, 2, N + 1, page_size, KVH, D]
            self.data = torch.zeros(layers, 2, num_pages + 1, page_size, kv_heads, head_dim,
                                    dtype=dtype, device=device)
        except torch.OutOfMemoryError as ex:
            raise CacheTooSmall(f"KV cache: could not allocate {num_pages} pages: {ex}") from ex
        # Flat per-layer views, made once: [L][N+1 * page_size, KVH, D] (a view,
        # so attention writes land in ``data``; no per-step view creation).
        flat = self.data.view(layers, 2, (num_pages + 1) * page_size, kv_heads, head_dim)
        self._flat = flat
        self._kv = [flat[i] for i in range(layers)]
        self._keys = [flat[i, 0] for i in range(layers)]
        self._values = [flat[i, 1] for i in range(layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat keys and values of one layer: ``[(N + 1) * page_size, KVH, D]`` each."""
        return self._keys[index], self._values[index]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys and values at flat positions ``slots`` ``[n]`` of every layer:
        ``[L, 2, n, KVH, D]``, a copy."""
        return self._flat.index_select(2, slots)

    def scatter(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` ``[L, 2, n, KVH, D]`` (``gather``'s) at ``slots`` ``[n]``."""
        self._flat.index_copy_(2, slots, kv)

    def layer_kv(self, index: int) -> torch.Tensor:
        """One layer's keys and values as one tensor ``[2, (N + 1) * page_size,
        KVH, D]``, for ops that write both (a compiled step writes a single
        tensor in place; two views of one storage it would copy whole)."""
        return self._kv[index]


def activation_reserve(*, hidden: int, intermediate: int, heads: int, kv_heads: int,
                       head_dim: int, vocab: int, itemsize: int, max_rows: int,
                       max_prefill_tokens: int, max_context: int, key_budget: int) -> int:
    """Bytes to leave free for activations beside the cache: a prefill of
    ``max_prefill_tokens`` (hidden states, MLP, projections), its grouped
    key gathers (``key_budget`` keys, repeated to all heads), the largest
    decode step's key gather and scores, and the slots' logits and sampling
    temporaries. Deliberately generous: running out mid-step fails rows."""
    prefill = max_prefill_tokens * (4 * hidden + 3 * intermediate + 3 * heads * head_dim) * 2
    prefill_attn = key_budget * (2 * kv_heads + 3 * heads) * head_dim
    decode = max_rows * max_context * (2 * kv_heads * head_dim + 2 * heads * 2)
    logits = max_rows * vocab * 48 // itemsize
    return (prefill + prefill_attn + decode + logits) * itemsize + (512 << 20)
