"""Peers timed in the same run as the engine: plain transformers on the same
model shape and the same text workload (32-token random prompts, a fixed
number of new tokens, greedy or drawn with the same ``sampling``, no stop
token).

    generate, static cache      ``model.generate(cache_implementation="static")``:
                                the fastest of transformers' own loops (it
                                compiles the decode step; the warm-up call has
                                the timed call's exact shapes, so compilation
                                is not timed)
    continuous batching         ``model.generate_batch`` with CUDA graphs when
                                ``ContinuousBatchingConfig`` offers them; the
                                warm-up call builds and keeps the manager, the
                                timed call reuses it

``streams`` requests are submitted at once; each peer returns a dict of
figures, or raises, and the caller turns the error into a table row. A peer
gets its own model instance (same config, its own random weights: a
forward's cost does not depend on the values).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable

import torch

NAMES = {"cb": "hf continuous batching", "generate": "hf generate (static cache)"}


class Peers:
    def __init__(self, make_model: Callable[[], torch.nn.Module], device: torch.device):
        self._make, self.device = make_model, device
        self._model = None

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = self._make()
        return self._model

    def _prompts(self, streams: int, prompt: int, seed: int) -> torch.Tensor:
        vocab = self.model.config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(1, vocab, (streams, prompt), generator=gen)  # [N, P]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, streams: int, prompt: int, new_tokens: int, sampling: dict | None = None) -> dict:
        """``sampling``: ``temperature`` and ``top_p`` to draw with (None: greedy)."""
        ids = self._prompts(streams, prompt, 1).to(self.device)  # [N, P]
        args = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
                    cache_implementation="static", **_drawing(sampling))
        with torch.no_grad():
            self.model.generate(ids, **args)  # warm-up: same shapes, compiles here
            self._sync()
            t = time.perf_counter()
            out = self.model.generate(ids, **args)  # [N, P + new]
            self._sync()
            wall = time.perf_counter() - t
        made = (out.shape[1] - prompt) * streams
        return _figures(streams, made, wall, new_tokens, "one batch, compiled decode step",
                        latency=True)

    def cb(self, streams: int, prompt: int, new_tokens: int, sampling: dict | None = None) -> dict:
        from transformers import GenerationConfig

        model = self.model
        inputs = self._prompts(streams, prompt, 2).tolist()
        gen = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0,
                               **_drawing(sampling))
        params = inspect.signature(model.generate_batch).parameters
        kwargs, note = {}, "default config"
        config_cls = _cb_config_class()
        if config_cls is not None and "continuous_batching_config" in params:
            fields = inspect.signature(config_cls).parameters
            options = {k: v for k, v in (("use_cuda_graph", True), ("max_memory_percent", 0.3))
                       if k in fields}
            kwargs["continuous_batching_config"] = config_cls(**options)
            note = "CUDA graphs" if "use_cuda_graph" in options else "no graph option"
        if "persistent_manager" in params:
            kwargs["persistent_manager"] = True
        else:
            note += "; manager rebuilt in the timed call"
        try:
            model.generate_batch(inputs=inputs, generation_config=gen, **kwargs)  # warm-up
            self._sync()
            t = time.perf_counter()
            res = model.generate_batch(inputs=inputs, generation_config=gen, **kwargs)
            self._sync()
            wall = time.perf_counter() - t
        finally:
            _drop_manager(model)
        made = sum(len(r.generated_tokens) for r in res.values())
        if made < streams * new_tokens:
            note += f"; only {made} of {streams * new_tokens} tokens came back"
        return _figures(streams, made, wall, new_tokens, note, latency=False)

    def close(self) -> None:
        self._model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _drawing(sampling: dict | None) -> dict:
    """generate's sampling arguments: greedy, or drawn with ``sampling``."""
    return dict(do_sample=False) if sampling is None else dict(do_sample=True, top_k=0, **sampling)


def _drop_manager(model) -> None:
    """Stop and forget the kept manager, never waiting on it for long (its
    thread may still be busy if a time limit cut the call short)."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    if manager is None:
        return

    def running() -> bool:
        with contextlib.suppress(Exception):
            return bool(manager.is_running())
        return False
    if running():
        with contextlib.suppress(Exception):
            manager.stop(block=True, timeout=5)
    with contextlib.suppress(Exception):
        if running():
            delattr(model, "_cached_continuous_batching_manager")
        else:
            model.destroy_cached_continuous_batching_manager()


def _cb_config_class():
    for where in ("transformers", "transformers.generation.configuration_utils"):
        with contextlib.suppress(Exception):
            return getattr(__import__(where, fromlist=["ContinuousBatchingConfig"]),
                           "ContinuousBatchingConfig")
    return None


def _figures(streams: int, tokens: int, wall: float, new_tokens: int, note: str,
             latency: bool) -> dict:
    """A batch that ends together has one latency, its wall time; the
    continuous batcher's per-request ends are not observed here."""
    lat = wall * 1e3 if latency else None
    return dict(requests=streams, tokens=tokens, wall_s=wall, steps=new_tokens,
                tok_s=tokens / wall, req_s=streams / wall, ms_step=wall / new_tokens * 1e3,
                p50_ms=lat, p99_ms=lat, note=note)
