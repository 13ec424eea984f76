"""CUDA graphs keyed by static shape, in one shared memory pool.

Static shapes are what make a step capturable: a decode step runs at a
padded batch size from ``batch_buckets`` (1, 2, 4, 8, then steps of 16) and
a padded page count from ``page_buckets`` (powers of two), so a few graphs
cover every step. Graphs are captured largest first into one pool (smaller
graphs reuse the larger ones' memory); this is safe because every replay
runs on the one compute stream (I1) and each output is consumed in stream
order before the next replay. Without CUDA, ``run`` calls the function
eagerly: the same code path, just not recorded.
"""

from __future__ import annotations

import bisect
import warnings
from typing import Callable, Hashable

import torch


def batch_buckets(max_rows: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_rows}
    sizes.update(range(16, max_rows + 1, 16))
    sizes.add(max_rows)
    return sorted(sizes)


def page_buckets(max_pages: int, min_pages: int = 1) -> list[int]:
    sizes, p = {max_pages}, max(1, min(min_pages, max_pages))
    while p < max_pages:
        sizes.add(p)
        p *= 2
    return sorted(sizes)


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest size >= ``n`` (``sizes`` sorted; ``n`` <= the largest)."""
    return sizes[bisect.bisect_left(sizes, n)]


class GraphSet:
    def __init__(self, device: torch.device, enabled: bool, share_pool_of: "GraphSet | None" = None):
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self.pool = None
        if self.enabled:  # sets sharing a pool must replay on one stream, outputs consumed in order
            self.pool = share_pool_of.pool if share_pool_of and share_pool_of.pool is not None \
                else torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def capture(self, key: Hashable, fn: Callable[[], object]) -> None:
        """Warm ``fn`` up on a side stream (lazy library initialisation must not
        land in the graph), then record it. Static inputs must already hold
        harmless values: the warm-up really runs."""
        if not self.enabled:
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self._graphs[key] = (graph, out)

    def capture_all(self, items) -> bool:
        """Capture each ``(key, prepare, fn)`` (``prepare`` puts harmless values
        in the static inputs first); on a capture failure (a model whose
        forward syncs with the host, say) drop all graphs, warn, and run
        eagerly. Returns whether graphs are in use."""
        if not self.enabled:
            return False
        # Set-up queued on other streams (a backend's buffers are made on the
        # default stream: ``last_token``'s zeros, the KV cache, the rotary
        # tables) must be done before the warm-ups really run on this one:
        # streams do not wait for each other, and a step that read a token id
        # before its zeros landed read out of bounds (an illegal address, now
        # and then). Captures run at build time only: a whole-device wait is free.
        torch.cuda.synchronize(self.device)
        try:
            for key, prepare, fn in items:
                prepare()
                self.capture(key, fn)
        except Exception as ex:  # noqa: BLE001 - any capture failure means "run eagerly"
            self.clear()
            self.enabled = False
            warnings.warn(f"CUDA graph capture failed, running steps eagerly: {ex!r}",
                          RuntimeWarning, stacklevel=2)
        return self.enabled

    def clear(self) -> None:
        self._graphs.clear()

    def run(self, key: Hashable, fn: Callable[[], object]) -> object:
        """Replay the graph for ``key`` on the current stream, or run ``fn``."""
        entry = self._graphs.get(key)
        if entry is None:
            return fn()
        graph, out = entry
        graph.replay()
        return out
