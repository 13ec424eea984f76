"""Whole decode steps of one model shape under several GEMM tile tables,
each built in the same process (a step's time moves by a few percent
between processes and machines; a comparison holds only within one).

    python -m bubblefree.bench.step_ab --model qwen05b
        --variant base --variant 896,1152=32n128k4s4w3p
        [--variant 2048,3072=64n256k4s4w3p+2048,2048=64n256k8s4w3p]
        [--rows 1,8] [--context 128] [--increments 896,1152=32n128k4s4w3p]

A variant is ``base`` (the defaults measured for the GPU and the shape:
``KernelConfig.measured``) or ``+``-joined items: row counts of the config
(``o_combines=0``, ``last_combines=2``, ``pdl_rows=0``, ``early_norms=8``,
``norms_in=1``;
``sample_ahead=0``: the captured step without its tokens sampled ahead), switches
(``draw_kernel=0``: drawn steps' noise in torch; ``cut_kernel=1``: drawn
steps with a cut sampled around the sort in two kernels; only requests
draw, ``bench.speed --variant``), counts of
the attention's dispatch (``split_warps=1``, ``split_block=64``, ``max_splits=4``,
``whole_rows=1``, ``whole_keys=256``) and ``K,N=TILE``
entries that replace the dependent-launch step's tile for the GEMM of that
weight shape (``KernelConfig.pdl_tiles``) in every bucket it runs; ``K,N:R=TILE``
only in the buckets of more than R rows, the defaults' tiles kept up to R
(``896,1152:1=32n128k4s4w3pe``: all but the one-row bucket). A q, k, v tile that
cuts K hands its sums to the attention kernels (``pdl_step.project_attend``).
A variant that fails (a tile the GPU cannot launch) is reported and skipped.
Each is timed as ``bench.profile_step`` times a captured step (GPU ms by
CUDA events; here the better of two timings of 200 replays), and the table
printed at the end; ``--increments`` adds ``bench.step_increments``' table
for one variant at the first row count.
"""

from __future__ import annotations

import argparse
import gc
import time

import attrs
import torch

from bubblefree.bench.profile_step import time_graph
from bubblefree.bench.speed_setup import SHAPES, build_model
from bubblefree.bench.step_increments import report
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.graphs import batch_buckets, bucket
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile, TileTable


# KernelConfig's row counts a variant may set (``o_combines=0``).
ROW_FIELDS = ("o_combines", "last_combines", "pdl_rows", "sample_ahead", "early_norms",
              "early_attention", "norms_in")
# KernelConfig's switches a variant may turn on or off (``draw_kernel=0``).
SWITCHES = ("draw_kernel", "cut_kernel")
# The attention dispatch's counts a variant may set (``split_warps=1``).
DISPATCH_FIELDS = ("max_splits", "split_block", "split_warps", "whole_rows", "whole_keys")


def variant(default: KernelConfig, text: str) -> KernelConfig:
    """``default`` with ``text``'s items: ``+``-joined tiles for its
    dependent step's table and row counts of ``ROW_FIELDS`` (see the
    module's doc); a clear error naming the part that is wrong."""
    if text == "base":
        return default
    fields, dispatch, entries = {}, {}, dict(default.pdl_tiles.entries)
    for item in text.split("+"):
        shape, _, tile = item.partition("=")
        if shape in SWITCHES:
            if tile not in ("0", "1"):
                raise ValueError(f"variant {text!r}: {shape} is 0 or 1, not {tile!r}")
            fields[shape] = tile == "1"
            continue
        if shape in ROW_FIELDS or shape in DISPATCH_FIELDS:
            if not tile.isdigit():
                what = "a row count" if shape in ROW_FIELDS else "a count"
                raise ValueError(f"variant {text!r}: {shape} is {what}, not {tile!r}")
            (fields if shape in ROW_FIELDS else dispatch)[shape] = int(tile)
            continue
        shape, colon, above = shape.partition(":")
        k, _, n = shape.partition(",")
        if not (k.strip().isdigit() and n.strip().isdigit() and tile) or (
                colon and not above.isdigit()):
            raise ValueError(f"variant {text!r}: {item!r} is not K,N=TILE nor K,N:ROWS=TILE "
                             "(e.g. 2048,3072=64n256k4s4w3p) nor FIELD=ROWS")
        if not default.pdl_rows:
            raise ValueError(f"variant {text!r}: this GPU and shape run no dependent-launch "
                             "step (KernelConfig.pdl_rows is 0), so its tiles change nothing")
        try:
            parsed = Tile.parse(tile)
        except ValueError as err:
            raise ValueError(f"variant {text!r}: {err}") from None
        if not parsed.fits(int(k)):
            raise ValueError(f"variant {text!r}: {tile} does not cut K={k} into whole steps of "
                             f"{parsed.block_k}, at least {parsed.ahead} a slice")
        kept = ()
        if colon:
            if int(above) >= default.pdl_rows:
                raise ValueError(f"variant {text!r}: {item!r} sets no bucket: the dependent "
                                 f"step runs up to {default.pdl_rows} rows")
            now = entries.get((int(k), int(n)), ())
            kept = tuple(e for e in now if e[0] <= int(above))
            if not kept or kept[-1][0] < int(above):  # rows up to R keep what they ran
                ran = TileTable({(int(k), int(n)): now}).tile_for(int(above), int(k), int(n))
                kept += ((int(above), ran),)
        entries[int(k), int(n)] = kept + ((default.pdl_rows, parsed),)
    try:
        chosen = attrs.evolve(default.dispatch, **dispatch)
    except ValueError as err:
        raise ValueError(f"variant {text!r}: {err}") from None
    return attrs.evolve(default, pdl_tiles=TileTable(entries), dispatch=chosen, **fields)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="phi")
    ap.add_argument("--variant", action="append", default=[], help="base, FIELD=ROWS, or K,N=TILE[+...]")
    ap.add_argument("--rows", default="1,8", help="decode buckets' rows, comma-separated")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--increments", default="", help="a variant whose step_increments table "
                    "to print")
    args = ap.parse_args(argv)
    variants = args.variant or ["base"]
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, not {args.rows!r}")
    if bad := [r for r in rows if r not in batch_buckets(64)]:
        ap.error(f"--rows must be decode buckets, of {batch_buckets(64)}, not {bad}")
    if args.context < 1:
        ap.error(f"--context must be at least 1, not {args.context}")
    if args.increments and args.increments not in variants:
        ap.error(f"--increments {args.increments!r} is not one of the --variant values")
    if not torch.cuda.is_available():
        raise SystemExit("bench.step_ab needs CUDA")
    model, label = build_model(False, shape=args.model)
    default = KernelConfig.measured("cuda", model.config, dtype=model.dtype)
    try:
        configs = {v: variant(default, v) for v in variants}
    except ValueError as err:
        ap.error(str(err))
    print(f"{label}; dependent launches up to {default.pdl_rows} rows", flush=True)
    results: dict[str, list[float]] = {}
    for name, kernels in configs.items():
        t = time.perf_counter()
        try:
            be = CudaBackend(model, page_size=16, num_pages=8192, max_rows=max(rows),
                             max_seqs=max(rows), max_prefill_tokens=2048,
                             max_context=max(256, 1 << args.context.bit_length()),
                             kernels=kernels, compile_decode=True)
            p = bucket(args.context // be.capacity.page_size + 1, be._pages)
            results[name] = [min(time_graph(be, b, p, args.context, iters=200) for _ in range(2))
                             for b in rows]
        except Exception as err:  # a tile the GPU cannot launch: the other variants still run
            print(f"{name}: failed, {type(err).__name__}: {str(err)[:300]}", flush=True)
            be = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        print(f"{name}: built in {time.perf_counter() - t:.0f} s; "
              + ", ".join(f"{ms:.3f} ms at {b} rows" for b, ms in zip(rows, results[name])),
              flush=True)
        if name == args.increments:
            print(report(be, model.config.num_hidden_layers, rows[0], args.context), flush=True)
        del be
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\nGPU ms per captured decode step, context {args.context}")
    print("| variant | " + " | ".join(f"{b} rows" for b in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, ms in results.items():
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in ms) + " |")


if __name__ == "__main__":
    main()
