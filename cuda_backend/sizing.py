"""How big things are: the model's attention shape, and how many KV pages
fit on the device.

On CUDA the page count comes from a fraction of the free device memory
after the weights, less a generous reserve for activations (see
``activation_reserve``); on the CPU it is a configured number.
"""

from __future__ import annotations

import attrs
import torch

from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.kv_cache import activation_reserve, page_bytes, pages_that_fit

CPU_DEFAULT_PAGES = 256


@attrs.frozen
class ModelDims:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int | None

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelDims":
        text = model.config.get_text_config()
        heads = text.num_attention_heads
        return cls(layers=text.num_hidden_layers, hidden=text.hidden_size,
                   intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
                   heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   vocab=model.get_output_embeddings().weight.shape[0],
                   max_positions=getattr(text, "max_position_embeddings", None))


def context_length(dims: ModelDims, max_context: int | None) -> int:
    """The longest sequence: the model's limit, capped by ``max_context``."""
    _check_positions(dims.max_positions)
    limits = [x for x in (dims.max_positions, max_context) if x is not None]
    if not limits:
        raise ValueError("max_context: the model config has no max_position_embeddings; pass one")
    return min(limits)


def _check_positions(positions) -> None:
    """A model config's max_position_embeddings of 0 or less (or not a
    number) would otherwise surface as a capacity error naming neither."""
    if positions is None:
        return
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        raise ModelLoadError(f"config.json: max_position_embeddings must be an integer >= 1, "
                             f"got {positions!r}")


def prefill_key_budget(max_prefill_tokens: int, max_context: int) -> int:
    """Keys a prefill gathers at once (rows * context): bounds its memory."""
    return max(4 * max_prefill_tokens, max_context)


def num_pages_for(dims: ModelDims, *, device: torch.device, dtype: torch.dtype, page_size: int,
                  fraction: float, max_rows: int, max_seqs: int, max_prefill_tokens: int,
                  max_context: int) -> int:
    """Pages that fit in ``fraction`` of free device memory after the reserve,
    but no more than ``max_seqs`` sequences of ``max_context`` could ever own."""
    if device.type != "cuda":
        return CPU_DEFAULT_PAGES
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    reserve = activation_reserve(
        hidden=dims.hidden, intermediate=dims.intermediate, heads=dims.heads,
        kv_heads=dims.kv_heads, head_dim=dims.head_dim, vocab=dims.vocab, itemsize=itemsize,
        max_rows=max_rows, max_prefill_tokens=max_prefill_tokens, max_context=max_context,
        key_budget=prefill_key_budget(max_prefill_tokens, max_context))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    per_page = page_bytes(dims.layers, dims.kv_heads, dims.head_dim, page_size, dtype)
    useful = max_seqs * -(-max_context // page_size)
    return min(pages_that_fit(int(free * fraction) - reserve, per_page), useful)
