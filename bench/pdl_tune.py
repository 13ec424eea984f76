"""Times the GEMMs of the dependent-launch decode step (``pdl_step``) for one
of ``bench.speed``'s model shapes, inside CUDA graphs, against cuBLAS.

Each GEMM is launched the way the step launches it: dependent on the one
before (``cuda_backend.pdl``), an output projection as partial sums with
the bias in the first slice, Llama's and Qwen2's gate and up projection
writing ``silu(gate) * up`` itself (its cuBLAS figure includes torch's
two kernels for that). An output projection is timed with the norm that
adds its slices to the residual stream (``add_norm``; torch's add and norm
after cuBLAS): more slices are more for that norm to read. Successive
launches read different copies of the weights, as a step's layers do, so
L2 cannot hold them. For each shape and row count: ``F.linear`` (cuBLAS,
plainly launched, which the step runs without dependent launches), the
tile the step runs now (``KernelConfig.measured``'s) and a grid of others;
at the second and later row counts only the first's ``--finalists``
fastest. ``--save`` writes the fastest tile per shape and row count as a
``kernel_config.TileTable`` (JSON) for ``KernelConfig.pdl_tiles``
(``bench.profile_step --pdl-tiles`` times it in whole steps); a GEMM left
out with ``--skip`` keeps the tile it has now. TB/s: the weights' bytes
over the time (with the norm, for an output projection).

    python -m bubblefree.bench.pdl_tune --model qwen05b [--rows 1,8] [--save tiles.json]
                                        [--wide] [--skip head]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from bubblefree.bench.attention_tune import L2_BYTES, time_in_graph
from bubblefree.bench.speed_setup import SHAPES
from bubblefree.cuda_backend import skinny_gemm as sg
from bubblefree.cuda_backend.add_norm import add_norm, torch_add_norm
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile, step_tile


def gemms(shape: str) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """The step's GEMMs of a model shape: name -> (K, N, partial, glu, bias)."""
    cfg = SHAPES[shape]["config"]()
    d, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    qkv = (heads + 2 * kv) * hd
    if cfg.model_type == "phi":
        return {"q,k,v,fc1": (d, qkv + inter, False, False, True),
                "dense+fc2": (heads * hd + inter, d, True, False, True),
                "head": (d, v, False, False, True)}
    bias = cfg.model_type == "qwen2"
    return {"q,k,v": (d, qkv, False, False, bias), "o": (heads * hd, d, True, False, False),
            "gate,up": (d, 2 * inter, False, True, False), "down": (inter, d, True, False, False),
            "head": (d, v, False, False, False)}


def grid(k: int, partial: bool, glu: bool = False, wide: bool = False) -> list[Tile]:
    """Columns per program, K per step (128 and 256, or 64 where neither
    divides K; 64 too for partial sums), for partial sums slices of K (any
    count: the kernel's slices need not divide K's steps evenly), and 1, 2
    or 4 steps of weights read before the wait; 4 warps (and 8 for the GLU,
    whose steps ahead take twice the registers), 3 stages. With ``wide``
    also 512 of K per step, 8 warps, and 2 to 5 stages (several times the
    tiles: each is a compile)."""
    steps = [b for b in (128, 256) + ((512,) if wide else ()) if k % b == 0] or [64]
    if partial and 64 not in steps:  # more, shorter slices
        steps = [64, *steps]
    blocks_n = (32, 64) if partial else (16, 32, 64) if glu else (16, 32, 64, 128)
    splits = (2, 3, 4, 6, 8, 12, 16, 24, 32) if partial else (1,)
    warps = (4, 8) if wide or glu else (4,)
    stages = (2, 3, 4, 5) if wide else (3,)
    out = [Tile(n, bk, s, w, st, a) for n, bk, s, w, st, a in itertools.product(
        blocks_n, steps, splits, warps, stages, (1, 2, 4))]
    return [t for t in out if t.fits(k)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="phi")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--save", default="")
    ap.add_argument("--wide", action="store_true", help="a larger grid (grid())")
    ap.add_argument("--finalists", type=int, default=6, help="tiles timed at the later row "
                    "counts: the fastest at the first")
    ap.add_argument("--skip", action="append", default=[], help="a GEMM not timed (e.g. head); "
                    "--save keeps its current tiles")
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config = SHAPES[args.model]["config"]()
    rms = config.model_type != "phi"
    current = KernelConfig.measured("cuda", config).pdl_tiles
    table: dict[str, list] = {}
    print(f"| {args.model} GEMM | rows | cuBLAS us | current | us | best | us | TB/s "
          "| best ÷ current |")
    print("|---|---:|---:|---|---:|---|---:|---:|---:|")
    for name, (k, n, partial, glu, has_bias) in gemms(args.model).items():
        if name in args.skip:
            for m in map(int, args.rows.split(",")):
                kept = current.tile_for(m, k, n)
                table.setdefault(f"{k},{n}", []).append([m, str(kept) if kept else None])
            continue
        torch.manual_seed(0)
        copies = 2 + (2 * L2_BYTES) // (n * k * 2)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        ranked: list[Tile] = []
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def torch_gemm(w):
                out = F.linear(x, w, bias)
                if glu:
                    gate, up = out.chunk(2, dim=-1)
                    out = F.silu(gate) * up
                return out

            want = torch_gemm(ws[0]).float()
            turn = itertools.cycle(ws)
            stream = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            norm = torch.ones(n, device="cuda", dtype=torch.bfloat16)
            norm_bias = None if rms else torch.zeros_like(norm)

            def cublas_step(w):
                out = torch_gemm(w)
                if partial:  # the residual add and the norm after it, as torch runs them
                    return torch_add_norm(stream, out.float()[None], norm, norm_bias, 1e-5, rms)
                return out

            cublas = time_in_graph(lambda: cublas_step(next(turn)))

            def ours(w, t):
                if partial:
                    return sg.launch(x, w, bias, t, bias_in_parts=True, pdl=True, partial=True)
                if glu:
                    return sg.launch(x, w, bias, t, glu=True, pdl=True)
                return sg.run(x, w, bias, t, pdl=True)

            def ours_step(w, t):
                out = ours(w, t)
                if partial:  # the norm that adds the slices: more slices, more for it to read
                    return add_norm(stream, out, norm, norm_bias, 1e-5, rms, pdl=True)
                return out

            timed = {}
            # What the step runs now: the measured table's tile, else step_tile's.
            now = current.tile_for(m, k, n) or step_tile(k, n // 2 if glu else n, m, partial, sms)
            for t in dict.fromkeys([now, *(ranked or grid(k, partial, glu, args.wide))]):
                turn = itertools.cycle(ws)
                try:
                    timed[t] = time_in_graph(lambda t=t: ours_step(next(turn), t))
                    got = ours(ws[0], t).float()
                except Exception as ex:  # noqa: BLE001 - e.g. a tile past shared memory
                    print(f"<!-- {name} {m} {t}: {type(ex).__name__} -->")
                    continue
                got = got.sum(0) if partial else got
                err = ((got - want).norm() / want.norm()).item()
                if err > 2e-2:
                    print(f"<!-- {name} {m} {t}: relative error {err:.3g}, dropped -->")
                    del timed[t]
            best = min(timed, key=timed.get)
            ranked = ranked or sorted(timed, key=timed.get)[:args.finalists]
            print(f"| {name} {k}->{n} | {m} | {cublas:.2f} | {now} | {timed.get(now, 0):.2f} "
                  f"| {best} | {timed[best]:.2f} | {n * k * 2 / timed[best] / 1e6:.2f} "
                  f"| {timed.get(now, 0) / timed[best]:.2f} |", flush=True)
            table.setdefault(f"{k},{n}", []).append([m, str(best)])
    if args.save:
        with open(args.save, "w") as f:
            json.dump(table, f)
        print(f"saved {args.save}: {json.dumps(table)}")


if __name__ == "__main__":
    main()
