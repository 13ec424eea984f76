"""What was measured on each GPU, and where it wins: the defaults that
``KernelConfig.measured`` (``for_gpu``) reads.

``MEASURED``: GEMM tiles faster than cuBLAS, per GPU, for the compiled
decode step. ``MEASURED_PDL``: per GPU and model shape (``model_shape``),
the dependent-launch step's buckets, tiles and settings, each with the run
that measured it. Both apply to 16-bit weights (``MEASURED_DTYPES``). A
GPU or shape not named here keeps the plain defaults until it is measured
(``bench.gemm_tune``, ``bench.pdl_tune``, ``bench.step_ab``).
"""

from __future__ import annotations

import types
from typing import Any, Mapping

import torch

from bubblefree.cuda_backend.kernel_config import Dispatch, Tile, TileTable

# Tiles measured faster than cuBLAS, per GPU, on the moondream2 text
# decoder's shapes (docs/performance.md, "Our GEMM for decode-sized inputs").
MEASURED: Mapping[str, TileTable] = types.MappingProxyType({
    "NVIDIA H200": TileTable({
        (2048, 14336): ((32, None), (64, Tile(64, 128, 1, 4, 3))),  # fused q, k, v, fc1
        (10240, 2048): ((1, None), (32, Tile(32, 128, 4, 4, 5)),  # fused dense + fc2
                        (64, Tile(64, 128, 4, 4, 5))),
        (2048, 51200): ((1, None), (8, Tile(32, 256, 1, 4, 3)),  # head
                        (32, Tile(128, 128, 1, 4, 3)), (64, None)),
    }),
})


def model_shape(config: Any) -> tuple | None:
    """What a measured decode step is keyed by: the architecture and the
    widths that fix its GEMMs (transformers' config names): model type,
    hidden size, MLP width, heads, KV heads, vocabulary. None without a
    config."""
    if config is None:
        return None
    heads = getattr(config, "num_attention_heads", None)
    return (getattr(config, "model_type", None), getattr(config, "hidden_size", None),
            getattr(config, "intermediate_size", None), heads,
            getattr(config, "num_key_value_heads", None) or heads, getattr(config, "vocab_size", None))


# The weights' dtypes the measured tiles and steps apply to: they were timed
# in bfloat16, and float16 moves the same bytes through the same tiles.
MEASURED_DTYPES = (torch.bfloat16, torch.float16)

PHI_15 = ("phi", 2048, 8192, 32, 32, 51200)  # Phi-1.5, moondream2's text decoder
LLAMA_32_1B = ("llama", 2048, 8192, 32, 8, 128256)
QWEN2_05B = ("qwen2", 896, 4864, 14, 2, 151936)

# Where the dependent-launch step (``pdl_step``) was measured faster, per
# GPU and model shape (``model_shape``: its GEMMs' shapes, which its tiles
# were tuned for; another shape of the same architecture is unmeasured and
# keeps the compiled step): the buckets of rows that run it, its GEMM
# tiles (``bench.pdl_tune``; docs/performance.md, "Dependent launches"),
# the buckets whose split attention's last programs combine, and those whose
# output projection combines the split kernel's states instead
# (``KernelConfig.o_combines``; at one row, 0.843 -> 0.830 ms for Llama-3.2-1B
# and 0.625 -> 0.606 for Qwen2-0.5B, each in a tile of its own there:
# docs/runs/o-combines-2026-12-02.txt). On
# the H200, at one row: a Phi-1.5-shaped step from 1.18 to 1.03 ms (0.95
# with the split kernel's keys read before the wait, ``Dispatch.prefetch``),
# Llama-3.2-1B's from 1.13 to 0.99 and Qwen2-0.5B's from 1.03 to 0.86 once
# the gate and up GEMM wrote silu(gate) * up itself
# (docs/runs/pdl-run-2026-12-01b.txt), then to 0.66 with Qwen2's output
# projections cut into slices that need not divide K
# (docs/runs/pdl-slices-2026-12-01f.txt), then to 0.62 (Llama's 0.86 to
# 0.85) with the q, k, v projection cut into slices that the attention
# kernels add (``pdl_step.project_attend``; docs/runs/qkv-slices-2026-12-01h.txt).
# Last, the buckets whose norms release the next kernel early
# (``KernelConfig.early_norms``; at one and eight rows Llama-3.2-1B's step
# from 0.835 to 0.794 ms and 0.921 to 0.882, Qwen2-0.5B's from 0.604 to
# 0.591 and 0.686 to 0.655, each with the tiles that read more before their
# wait; Phi-1.5's slower with it, 0.890 to 1.006: docs/runs/early-norms-2026-12-03.txt).
# Then Qwen2-0.5B's q, k, v projection in the vector form at one and two
# rows (``skinny_gemv``; docs/runs/vector-gemm-2026-12-03.txt).
# Then Llama-3.2-1B's split attention kernel releasing the output
# projection early at one row (``KernelConfig.early_attention``; 0.791 ->
# 0.777 ms a step, Qwen2-0.5B's within 0.004: docs/runs/early-attention-2026-12-03.txt).
# Last, Llama-3.2-1B's and Qwen2-0.5B's one-row bucket without norm kernels
# (``KernelConfig.norms_in``; 0.776 -> 0.770 and 0.550 -> 0.483 ms a step;
# slower from two rows, 0.579 -> 0.710 for Qwen2: docs/runs/norms-in-2026-12-04.txt).
# There the q, k, v, o and down GEMMs take ``normed_gemv.choose``'s launches
# (the tiles below that cut K are what the bucket runs without it), gate
# and up Qwen2's vector tile with K whole, and ``o_combines`` and
# ``early_attention`` do not apply.
# Then the attention dispatch: the buckets whose split attention runs a
# (row, head) in one program (``Dispatch.whole_rows``, ``whole_keys``).
# At context 128 (256 keys): Llama-3.2-1B's up to four rows (0.771 -> 0.735
# ms a step at one row, 0.852 -> 0.831 at four; slower at eight, 0.878 ->
# 0.910), Phi-1.5's up to eight (0.958 -> 0.930 at four, 1.015 -> 0.964 at
# eight; 0.900 -> 0.909 at two), Qwen2-0.5B's even at one row and slower
# from two. At context 384 (512 keys): Llama 0.781 -> 0.758 at one row,
# 0.873 -> 0.859 at four; Qwen2 0.491 -> 0.470 at one row; Phi faster up
# to four rows but slower at eight (1.152 -> 1.174), so Phi's stop at 256
# keys: docs/runs/whole-attention-2026-12-04.txt.
# (pdl_rows, pdl_tiles, last_combines, o_combines, early_norms, early_attention, norms_in,
#  dispatch)
PdlDefaults = tuple[int, TileTable, int, int, int, int, int, Dispatch]
MEASURED_PDL: Mapping[str, Mapping[tuple, PdlDefaults]] = types.MappingProxyType({
    "NVIDIA H200": types.MappingProxyType({
        PHI_15: (8, TileTable({
            (2048, 14336): ((8, Tile(64, 128, 1, 4, 3)),),  # fused q, k, v, fc1
            (10240, 2048): ((8, Tile(64, 256, 8, 4, 3)),),  # fused dense + fc2, sums
            (2048, 51200): ((8, Tile(128, 128, 1, 4, 3)),),  # head
        # last_combines: 1 and 2 rows (docs/runs/last-combines-2026-12-02.txt)
        }), 2, 0, 0, 0, 0, Dispatch(whole_rows=8)),
        LLAMA_32_1B: (8, TileTable({
            # q, k, v, sums to attention; 8 warps, each slice's four steps read
            # before the wait (the norm before it releases it early)
            (2048, 3072): ((8, Tile(64, 256, 2, 8, 3, 4)),),
            # o, sums; at one row combining the split kernel's states (o_combines)
            (2048, 2048): ((1, Tile(128, 256, 8, 4, 3)), (8, Tile(64, 256, 8, 4, 3))),
            (2048, 16384): ((8, Tile(32, 256, 1, 4, 3)),),  # gate and up, silu(gate) * up
            (8192, 2048): ((8, Tile(64, 256, 8, 4, 3, 2)),),  # down, sums, two steps ahead
            (2048, 128256): ((8, Tile(64, 128, 1, 4, 3)),),  # head
        # last_combines: 1 and 2 rows (docs/runs/last-combines-2026-12-02.txt)
        }), 2, 1, 8, 1, 1, Dispatch(whole_rows=4, whole_keys=512)),
        QWEN2_05B: (8, TileTable({
            # q, k, v, sums to attention; at one and two rows the vector form
            # (0.588 -> 0.570 and 0.615 -> 0.600 ms a step; slower from four
            # rows: docs/runs/vector-gemm-2026-12-03.txt)
            # At one row, it and gate and up and down let the next kernel launch
            # before they load and wait (``Tile.early``; 0.571 -> 0.550 ms a
            # step: docs/runs/held-2026-12-03.txt).
            # From two rows every GEMM, the head included, in the MMA form lets
            # the next kernel launch before it loads and waits (0.598, 0.631,
            # 0.656 -> 0.588, 0.608, 0.626 ms a step at 2, 4, 8 rows), and
            # q, k, v at two rows in the vector form too (0.586 -> 0.578):
            # docs/runs/held-2026-12-03b.txt.
            (896, 1152): ((2, Tile(16, 128, 4, 4, 1, vector=1, early=1)),
                          (8, Tile(32, 128, 4, 4, 3, early=1))),
            # o and down: slices of K that need not divide it (down's 38 steps of
            # 128 in 8 slices of 4 and 5), timed with the norm that adds them.
            # o, sums; at one row combining the split kernel's states (o_combines),
            # in one slice a head, 64 columns a program (0.600 and 0.604 ms a
            # step against 0.606 and 0.610 with 32, in two calls: performance.md)
            (896, 896): ((1, Tile(64, 64, 14, 4, 3)), (8, Tile(32, 128, 4, 4, 3, early=1))),
            # gate and up, silu(gate) * up
            (896, 9728): ((1, Tile(8, 128, 1, 4, 1, vector=1, early=1)),
                          (8, Tile(32, 128, 1, 4, 3, early=1))),
            # down, sums; each slice's first four steps read before the wait
            (4864, 896): ((1, Tile(64, 256, 19, 4, 1, vector=1, early=1)),
                          (8, Tile(32, 128, 8, 4, 3, 4, early=1))),
            (896, 151936): ((1, Tile(64, 128, 1, 4, 3)), (8, Tile(64, 128, 1, 4, 3, early=1))),  # head
        }), 0, 1, 8, 0, 1, Dispatch(whole_rows=1, whole_keys=512)),
    }),
})
