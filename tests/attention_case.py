"""A decode attention case on CUDA for the kernels that rotate, write and
attend the step's own key (``rope_attention``, ``paged_decode``'s
``NewToken``): shared by the tests of the one-pass, split and whole
kernels."""

from __future__ import annotations

import torch

PAGE = 16  # keys a page
DIM = 64  # a head's width
HEADS = 4  # query heads


def rope_case(kv_heads: int, window, dtype, pages: int, rot: int, rows: int = 6):
    """Two equal caches of random entries, rows on disjoint scattered pages
    at positions 0 (the own key alone), mid-page, a page's end and start,
    and the bucket's last; raw q, k, v as views of one projection output
    (with 8 columns past them); rotary tables for ``rot`` dims. Returns
    ``(caches, table, positions, slot, q, k, v, cos, sin, win)``, ``win``
    the window as the kernels take it."""
    from bubblefree.cuda_backend import paged_decode as pd
    from bubblefree.cuda_backend.kv_cache import PagedKVCache
    total = rows * pages + 3
    caches = [PagedKVCache(layers=1, kv_heads=kv_heads, head_dim=DIM, num_pages=total,
                           page_size=PAGE, dtype=dtype, device=torch.device("cuda"))
              for _ in range(2)]
    caches[0].data.normal_()
    caches[1].data.copy_(caches[0].data)
    table = torch.randperm(total, device="cuda")[:rows * pages].view(rows, pages)
    positions = torch.tensor([0, 3, 15, 16, min(40, pages * PAGE - 2), pages * PAGE - 1][:rows],
                             device="cuda")
    slot = table.gather(1, (positions // PAGE)[:, None])[:, 0] * PAGE + positions % PAGE
    qkv = torch.randn(rows, (HEADS + 2 * kv_heads) * DIM + 8, device="cuda", dtype=dtype)
    q, k, v = qkv[:, :-8].split((HEADS * DIM, kv_heads * DIM, kv_heads * DIM), dim=1)
    q, k, v = (q.view(rows, HEADS, DIM), k.view(rows, kv_heads, DIM),
               v.view(rows, kv_heads, DIM))
    theta = torch.rand(rows, rot // 2, device="cuda") * 6
    cos, sin = (f(torch.cat((theta, theta), 1)).to(dtype) for f in (torch.cos, torch.sin))
    return caches, table, positions, slot, q, k, v, cos, sin, window or pd.NO_WINDOW
