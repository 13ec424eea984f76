"""Times the decode step's GEMMs at decode batch sizes, inside CUDA graphs:
the Phi-1.5 fused input projection (2048 -> 14336), the fused output
projection (10240 -> 2048) and the head (2048 -> 51200), bf16.

At 1-64 rows a GEMM is one pass over its weights, so the figure that
matters is weight bytes per second. Successive calls read different copies
of the weights, as the layers of a step do, so the H200's 50 MB L2 cannot
hold them from one call to the next. Compared for each shape and rows:

- ``linear``: ``F.linear`` on the ``[N, K]`` weight (what the step runs);
- ``mm_kn``: ``addmm`` on the same weight stored ``[K, N]``: cuBLAS picks
  its kernel per layout;
- our Triton kernel (``cuda_backend.skinny_gemm``) at each tile in a grid,
  with its reducing kernel where it splits K; then the best tile per case
  against cuBLAS. ``--save`` writes the tiles that beat cuBLAS by 3% or more
  as a ``kernel_config.TileTable`` (JSON, ``TileTable.read``) that
  ``bench.profile_step --gemm`` times in whole steps.

(inductor's max-autotune, compiled with a dynamic row count as the step is,
was measured at 0.1-1.9 TB/s, far below cuBLAS: docs/performance.md.)

    python -m bubblefree.bench.gemm_tune [--rows 1,8,32,64] [--tiles 64n128k4s4w3p,...]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from bubblefree.bench.attention_tune import L2_BYTES, time_in_graph
from bubblefree.cuda_backend import skinny_gemm as sg
from bubblefree.cuda_backend.kernel_config import Tile

SHAPES = {"input 2048->14336": (2048, 14336), "output 10240->2048": (10240, 2048),
          "head 2048->51200": (2048, 51200)}


def tiles() -> list[Tile]:
    return [Tile(n, k, split, 4, stages) for n, k, split, stages in itertools.product(
        (32, 64, 128), (128, 256), (1, 2, 4, 8, 16), (3, 5))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--tiles", default="", help="our kernel's tiles (default: a grid)")
    ap.add_argument("--save", default="", help="write the winning tiles here (JSON)")
    args = ap.parse_args(argv)
    grid = [Tile.parse(t) for t in args.tiles.split(",") if t] or tiles()
    best: dict[tuple[str, int], tuple[int, int, float, str, float]] = {}  # k, n, cuBLAS, ours
    print("| GEMM | rows | variant | us | weight TB/s |")
    print("|---|---:|---|---:|---:|")
    for name, (k, n) in SHAPES.items():
        torch.manual_seed(0)
        copies = 2 + (2 * L2_BYTES) // (n * k * 2)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        ws_kn = [w.t().contiguous() for w in ws]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, ws[0], bias).float()
            variants = {"linear": (lambda w: F.linear(x, w, bias), ws),
                        "mm_kn": (lambda w: torch.addmm(bias, x, w), ws_kn)}
            for tile in grid:
                if tile.fits(k):
                    variants[str(tile)] = (lambda w, t=tile: sg.run(x, w, bias, t)), ws
            timed = {}
            for label, (fn, mats) in variants.items():
                turn = itertools.cycle(mats)
                try:
                    us = timed[label] = time_in_graph(lambda: fn(next(turn)))
                except Exception as ex:  # noqa: BLE001 - e.g. a tile past shared memory
                    print(f"| {name} | {m} | {label} | failed: {type(ex).__name__} | |")
                    continue
                err = (fn(mats[0]).float() - want).abs().max().item()
                print(f"| {name} | {m} | {label} | {us:.2f} | {n * k * 2 / us / 1e6:.2f} |"
                      + (f" max diff {err:.3g}" if err > 0.05 else ""), flush=True)
            ours = min((t for t in timed if t not in ("linear", "mm_kn")), key=timed.get,
                       default=None)
            if ours is not None:
                best[name, m] = (k, n, timed["linear"], ours, timed[ours])
    print("\nbest tile of ours against cuBLAS (F.linear):")
    print("| GEMM | rows | cuBLAS us | ours | us | ratio |")
    print("|---|---:|---:|---|---:|---:|")
    table: dict[str, list] = {}
    for (name, m), (k, n, cublas, tile, us) in best.items():
        print(f"| {name} | {m} | {cublas:.2f} | {tile} | {us:.2f} | {cublas / us:.2f} |")
        table.setdefault(f"{k},{n}", []).append([m, tile if cublas / us >= 1.03 else None])
    if args.save:
        with open(args.save, "w") as f:
            json.dump(table, f)
        print(f"saved {args.save}: {table}")  # null: cuBLAS at those rows


if __name__ == "__main__":
    main()
