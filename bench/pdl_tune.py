"""Times the GEMMs of the dependent-launch decode step (``pdl_step``) for one
of ``bench.speed``'s model shapes, inside CUDA graphs, against cuBLAS.

Each GEMM is launched the way the step launches it: dependent on the one
before (``cuda_backend.pdl``), an output projection as partial sums with
the bias in the first slice, Llama's and Qwen2's gate and up projection
writing ``silu(gate) * up`` itself (its cuBLAS figure includes torch's
two kernels for that). Successive launches read different copies of
the weights, as a step's layers do, so L2 cannot hold them. For each shape
and row count: ``step_tile``'s tile, a grid of others, and ``F.linear``
(cuBLAS, plainly launched, which the step runs without dependent
launches). ``--save`` writes the fastest tile per shape and row count as a
``kernel_config.TileTable`` (JSON) for ``KernelConfig.pdl_tiles``
(``bench.profile_step --pdl-tiles`` times it in whole steps).

    python -m bubblefree.bench.pdl_tune --model qwen05b [--rows 1,8] [--save tiles.json] [--wide]
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
from bubblefree.cuda_backend.kernel_config import Tile, step_tile


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


def grid(k: int, partial: bool, wide: bool = False) -> list[Tile]:
    """Columns per program, K per step (128 and 256, or 64 where neither
    divides K) and, for partial sums, slices of K; 4 warps, 3 stages. With
    ``wide`` also 512 of K per step, 8 warps, and 2 to 5 stages (six times
    the tiles: each is a compile)."""
    steps = [b for b in (128, 256) + ((512,) if wide else ()) if k % b == 0] or [64]
    blocks_n = (32, 64) if partial else (16, 32, 64, 128)
    splits = (2, 4, 8, 16) if partial else (1,)
    warps, stages = ((4, 8), (2, 3, 4, 5)) if wide else ((4,), (3,))
    out = [Tile(n, bk, s, w, st) for n, bk, s, w, st in itertools.product(
        blocks_n, steps, splits, warps, stages)]
    return [t for t in out if t.fits(k)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="phi")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--save", default="")
    ap.add_argument("--wide", action="store_true", help="a grid six times larger (grid())")
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table: dict[str, list] = {}
    print(f"| {args.model} GEMM | rows | cuBLAS us | step_tile | us | best | us | TB/s | best ÷ cuBLAS |")
    print("|---|---:|---:|---|---:|---|---:|---:|---:|")
    for name, (k, n, partial, glu, has_bias) in gemms(args.model).items():
        torch.manual_seed(0)
        copies = 2 + (2 * L2_BYTES) // (n * k * 2)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
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
            cublas = time_in_graph(lambda: torch_gemm(next(turn)))

            def ours(w, t):
                if partial:
                    return sg.launch(x, w, bias, t, bias_in_parts=True, pdl=True, partial=True)
                if glu:
                    return sg.launch(x, w, bias, t, glu=True, pdl=True)
                return sg.run(x, w, bias, t, pdl=True)

            timed = {}
            default = step_tile(k, n // 2 if glu else n, m, partial, sms)
            for t in dict.fromkeys([default, *grid(k, partial, args.wide)]):
                turn = itertools.cycle(ws)
                try:
                    timed[t] = time_in_graph(lambda t=t: ours(next(turn), t))
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
            print(f"| {name} {k}->{n} | {m} | {cublas:.2f} | {default} | {timed.get(default, 0):.2f} "
                  f"| {best} | {timed[best]:.2f} | {n * k * 2 / timed[best] / 1e6:.2f} "
                  f"| {cublas / timed[best]:.2f} |", flush=True)
            table.setdefault(f"{k},{n}", []).append([m, str(best)])
    if args.save:
        with open(args.save, "w") as f:
            json.dump(table, f)
        print(f"saved {args.save}: {json.dumps(table)}")


if __name__ == "__main__":
    main()
