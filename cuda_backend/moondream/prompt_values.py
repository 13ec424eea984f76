"""A prefill's prompt values (``core.values.PromptValue``: moondream's
spatial references) as the forward's inputs, on the device.

At a value's position the input is the region encoder's output for the
value (``encode_coordinate`` for a COORD, ``encode_size`` for a SIZE,
both in the model's dtype, as moondream's reference encodes its
``spatial_refs``), not the placeholder token's embedding. The host knows
where each value lands in the packed prefill (rows are packed in order,
``ModelRunner.pack_prefill``), so it stages, per value, its packed index,
its kind and its two floats (a coordinate in the first) into a pinned
buffer of the slot, copied with the step's other metadata; the device
encodes them and writes them over the embeddings. No host sync.

The graph path (``prefill_graphs``) encodes a fixed ``GRAPH_VALUES`` rows
per replay (a step with more runs eagerly); the eager path as many as the
step has.
"""

from __future__ import annotations

import numpy as np
import torch

from bubblefree.core.values import ValueKind
from bubblefree.cuda_backend.moondream.region_head import COORD, SIZE

GRAPH_VALUES = 32  # values a prefill graph encodes; the rest of its rows are padding


def locate(rows, inputs: list, offsets: list[int]) -> list[tuple[int, int, float, float]]:
    """(packed index, kind code, v0, v1) of every prompt value of a step:
    row i's inputs start at the sum of the earlier rows' lengths, and its
    prompt at ``offsets[i]`` within them (past an image's prefix)."""
    out, at = [], 0
    for row, ids, off in zip(rows, inputs, offsets):
        for pv in row.prompt_values:
            if pv.kind is ValueKind.SIZE:
                out.append((at + off + pv.index, SIZE, float(pv.value[0]), float(pv.value[1])))
            else:
                out.append((at + off + pv.index, COORD, float(pv.value), 0.0))
        at += len(ids)
    return out


def stage(staging: np.ndarray, found: list, n: int) -> None:
    """``found`` into an int64 buffer laid out ``[index n | kind n | values
    2n as float64 bits]``; entries past ``len(found)`` are padding (index
    -1, a coordinate of 0)."""
    k = len(found)
    staging[:4 * n] = 0
    staging[:n] = -1
    if k:
        index, kind, v0, v1 = (np.array(col) for col in zip(*found))
        staging[:k], staging[n:n + k] = index, kind
        floats = staging[2 * n:4 * n].view(np.float64).reshape(n, 2)
        floats[:k, 0], floats[:k, 1] = v0, v1


def unpack(meta: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``stage``'s layout on the device: index ``[n]``, kind ``[n]``, values ``[n, 2]`` float32."""
    return meta[:n], meta[n:2 * n], meta[2 * n:4 * n].view(torch.float64).view(n, 2).float()


def encode(region, kind: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inputs ``[n, D]`` of ``n`` values: each row's kind picks its encoder."""
    v = values.to(dtype)
    return torch.where((kind == SIZE).unsqueeze(1), region.encode_size(v),
                       region.encode_coordinate(v[:, :1]))


def overwrite(x: torch.Tensor, region, meta: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` ``[T, D]`` with the staged values' inputs at their indices
    (fixed shape: padding entries, index -1, change nothing)."""
    index, kind, values = unpack(meta, n)
    enc = encode(region, kind, values, x.dtype)  # [n, D]
    t = x.shape[0]
    # Which value row each position takes, -1 for none; padding entries aim at
    # an extra slot t that is dropped (real indices are distinct: the core
    # keeps a row's increasing, and rows pack apart).
    aim = torch.where(index >= 0, index, t)
    hit = torch.full((t + 1,), -1, dtype=torch.long, device=x.device)
    hit = hit.index_copy(0, aim, torch.arange(n, device=x.device))[:t]
    return torch.where((hit >= 0).unsqueeze(1), enc.index_select(0, hit.clamp(min=0)), x)
