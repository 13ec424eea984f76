"""Qwen2-VL's and Qwen2.5-VL's 3-D rotary positions on the paged pipeline.

Over an image the model's rotary positions are (time, height, width) of
each feature; text before it counts 0, 1, 2... in all three, text after it
goes on from the largest position so far plus one. So once a row has an
image, its rotary position is its KV position plus a delta (usually
negative: an image of h x w features spans about max(h, w) positions). The
prefill takes the model's own positions (``get_rope_index``) and leaves
each row's delta in ``MropeRunner.rope_delta`` at its row slot, on the
device; a decode step adds it to the positions its rotary reads, never to
those its KV writes use (the context is built from the plain ones).
"""

from __future__ import annotations

import numpy as np
import torch

from bubblefree.cuda_backend.runner import ModelRunner


class MropeRunner(ModelRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # [max_seqs + 1]: each row slot's rotary delta, 0 for a text-only row
        self.rope_delta = torch.zeros(self.cap.max_seqs + 1, dtype=torch.long, device=self.device)

    def decode_inputs(self, b: int, p: int):
        input_ids, positions, ctx = super().decode_inputs(b, p)  # ctx: the KV positions
        row_slots = self.meta_views(self.decode_meta, b, p)[0]
        return input_ids, positions + self.rope_delta.index_select(0, row_slots), ctx


def rope_positions(vlm: torch.nn.Module, inputs: list[np.ndarray], grids: list[torch.Tensor],
                   starts: np.ndarray, image_token_id: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Each row's ids ``inputs`` (head, block, prompt), its image's grid
    ``[1, 3]`` and first position -> each row's rotary positions ``[3, L]``
    and delta ``[R]``, computed on the host by the model's own
    ``get_rope_index``."""
    positions, deltas = [], []
    for ids, grid, start in zip(inputs, grids, starts):
        row = torch.from_numpy(ids)[None]
        kinds = (row == image_token_id).to(torch.int)
        pos, delta = vlm.model.get_rope_index(row, kinds, image_grid_thw=grid.cpu())
        positions.append(pos[:, 0].numpy() + int(start))
        deltas.append(int(delta.reshape(-1)[0]))
    return positions, np.array(deltas, dtype=np.int64)
