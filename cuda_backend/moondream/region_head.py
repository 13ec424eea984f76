"""The spatial decode of the finalize phase, on the device.

For a step whose SamplePlan asks values, after its tokens are sampled:
each row's hidden state (the last block's output before the final norm)
goes through both region decoders; a bin is picked per head (argmax at
temperature 0, else Gumbel-max seeded by the row's seed and position, like
a token, with a salt of its own per head so a value's draw is independent
of the token's); the bins become values (``region.coordinate_value``,
``region.size_value``), and the value of the row's kind becomes its next
input embedding (``encode_coordinate`` / ``encode_size``). Every shape is
fixed by the row bucket, so the whole decode is one CUDA graph per bucket.

Kinds on the device are small ints: ``NONE``, ``COORD``, ``SIZE``.
"""

from __future__ import annotations

import torch

from bubblefree.core.values import ValueKind
from bubblefree.cuda_backend.moondream.region import RegionModel, coordinate_value, size_value
from bubblefree.cuda_backend.sampling import Draw, mix32, sample_tokens, unpack_sampling

NONE, COORD, SIZE = 0, 1, 2
KIND_CODES = {None: NONE, ValueKind.COORD: COORD, ValueKind.SIZE: SIZE}
# Per-head salts: bins of different heads (and tokens) at one position draw
# from independent uniforms.
_SALTS = {"coord": 0x85EBCA6B, "width": 0xC2B2AE35, "height": 0x27D4EB2F}


class RegionHead:
    def __init__(self, region: RegionModel, max_rows: int, device: torch.device):
        cfg = region.config
        self.region = region
        self.coord_bins, self.size_bins = cfg.coord_out_dim, cfg.size_out_dim // 2
        # One all-allowed mask row per bin count: sample_tokens' mask table.
        self._tables = {n: torch.ones(1, n, dtype=torch.bool, device=device)
                        for n in (self.coord_bins, self.size_bins)}
        self._zeros = torch.zeros(max_rows, dtype=torch.long, device=device)  # [max_rows]
        self._salts = {
            head: mix32(torch.arange(n, dtype=torch.long, device=device) ^ c)
            for (head, c), n in zip(_SALTS.items(),
                                    (self.coord_bins, self.size_bins, self.size_bins))}

    def decode(self, hidden: torch.Tensor, kinds: torch.Tensor, inputs: torch.Tensor, b: int,
               greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden ``[b, D]``, kinds ``[b]`` and the step's sampling inputs
        (``pack_sampling``'s layout) -> values ``[b, 2]`` float32 (a
        coordinate in column 0; a size as (width, height)) and the rows'
        next input embeddings ``[b, D]`` (rows of no kind get a coordinate's:
        unused, their flag is off)."""
        _, _, draws = unpack_sampling(inputs, b)
        zeros = self._zeros[:b]

        def pick(logits: torch.Tensor, head: str) -> torch.Tensor:  # [b, n] -> [b]
            table = self._tables[logits.shape[-1]]
            # The request's cuts on a head's few bins: the sort is cheap there.
            return sample_tokens(logits.float(), table, zeros, draws, self._salts[head],
                                 Draw.GREEDY if greedy else Draw.CUT)

        coord_logits = self.region.decode_coordinate(hidden)  # [b, coord bins]
        size_logits = self.region.decode_size(hidden)  # [b, 2, size bins]
        coord = coordinate_value(pick(coord_logits, "coord"), self.coord_bins)  # [b]
        size = torch.stack([size_value(pick(size_logits[:, 0], "width"), self.size_bins),
                            size_value(pick(size_logits[:, 1], "height"), self.size_bins)],
                           dim=-1)  # [b, 2]
        is_size = (kinds == SIZE).unsqueeze(1)  # [b, 1]
        values = torch.where(is_size, size, torch.stack([coord, torch.zeros_like(coord)], -1))
        # Encoded in the model's dtype, as the values would be fed back.
        dtype = hidden.dtype
        embeds = torch.where(is_size, self.region.encode_size(size.to(dtype)),
                             self.region.encode_coordinate(coord.to(dtype).unsqueeze(1)))
        return values, embeds  # [b, 2], [b, D]
