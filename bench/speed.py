"""Speed benchmark: the engine pipelined and blocking, and plain transformers,
in one process on one GPU, on one model shape: moondream2's text decoder
(Phi-1.5), Llama-3.2-1B or Qwen2-0.5B, with random bf16 weights.

    python -m bubblefree.bench.speed [--model phi|llama1b|qwen05b] [--tiny] [--quick] [--streams 1,8,32,64]
                          [--workloads text,detect,point,mix[,sampled]] [--decode fused+compile]
                          [--split-below PROGRAMS] [--attention 4x32w4s1] [--gemm cublas]
                          [--variant 896,1152=32n128k2s4w3p+sample_ahead=0]
                          [--out docs/benchmarks.md] [--plot docs/benchmarks.png]

One backend is built (its CUDA graphs captured once); every cell runs a
closed loop of requests on a fresh Engine over it, alternating pipelined,
blocking and auto (launch ahead or not, chosen per tick) runs. Per cell: tokens/s, requests/s, ms per step, GPU idle per
step (CUDA events on the compute stream, read after the run), the step as a
multiple of the read floor (the weights ÷ the read bandwidth measured at the
start of the same run: a batch-1 step reads every weight once), latency
p50/p99. Then the peers on the text
workload, the seed's speedup model for the detect workload, and the main
table last. Each cell prints a JSON line as it completes (also appended to
$OUT/bench.jsonl when OUT is set, with copies of the docs file and the
plot at the end); a failing cell prints its error and the run goes on; a
cell or a peer that runs past its time limit is stopped, no engine cell
starts after ``--budget`` seconds and nothing runs past ``--deadline``.
``--tiny`` runs a tiny random model of the shape's architecture on the
CPU, so the whole command can be tested without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import threading
import time

import attrs
import torch
import transformers

from bubblefree.bench import speed_report as report
from bubblefree.bench.peers import NAMES as PEER_NAMES, Peers
from bubblefree.bench.speed_cells import (DEFAULT_WORKLOADS, FULL_TOKENS, PROMPT, QUICK_TOKENS, SAMPLED,
                                          WORKLOADS, TimedBackend, bin_masks, make_requests,
                                          request_count, run_closed_loop)
from bubblefree.bench.speed_setup import (DECODE_PATHS, SHAPES, Clock, TimeLimit, build_model,
                                          read_bandwidth, time_limit, weight_bytes)
from bubblefree.core import Engine
from bubblefree.cuda_backend.kernel_config import KernelConfig, Launch, TileTable

ENGINE_MODE = {"pipelined": True, "blocking": False, "auto": "auto"}  # report.MODES -> Engine(pipelined=)
CONTEXT = 256  # prompt + the longest output (152) fits; one page bucket of graphs


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m bubblefree.bench.speed", description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(SHAPES), default="phi",
                    help="the model's shape: Phi-1.5 (moondream2's text decoder), Llama-3.2-1B or "
                         "Qwen2-0.5B, random bf16 weights (default phi)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model of that architecture on the CPU")
    ap.add_argument("--quick", action="store_true", help="fewer tokens, requests and runs")
    ap.add_argument("--streams", default=None, help="concurrency levels (default 1,8,32,64; "
                    "1,8 with --quick)")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"of {','.join(WORKLOADS)} (sampled: the text drawn at {SAMPLED})")
    ap.add_argument("--peer-streams", default="1,32", help="peers run the text (and sampled) workload at these")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per mode and cell, the last with the timing hook (default 3; 2 quick)")
    ap.add_argument("--budget", type=float, default=300.0,
                    help="seconds after which no new engine cell starts")
    ap.add_argument("--deadline", type=float, default=500.0,
                    help="seconds by which everything (peers included) is stopped")
    ap.add_argument("--cell-timeout", type=float, default=120.0)
    ap.add_argument("--peer-timeout", type=float, default=120.0)
    ap.add_argument("--decode", choices=list(DECODE_PATHS), default="fused+compile",
                    help="how the engine runs a decode step (compile applies on CUDA only)")
    ap.add_argument("--split-below", type=int, default=None, metavar="PROGRAMS",
                    help="use the split attention kernel for buckets of fewer (row, head) "
                         "programs than this (default: KernelConfig's dispatch)")
    ap.add_argument("--attention", type=Launch.parse, default=None, metavar="LAUNCH",
                    help="the one-pass attention kernel's launch wherever it runs, "
                         "HEADSxBLOCKwWARPSsSTAGES (default: KernelConfig's dispatch)")
    ap.add_argument("--pdl-rows", type=int, default=None, metavar="ROWS",
                    help="decode buckets of at most ROWS rows run the dependent-launch step "
                         "(KernelConfig.pdl_rows; 0: none; default: as measured for the GPU "
                         "and the model's architecture)")
    ap.add_argument("--o-combines", type=int, default=None, metavar="ROWS",
                    help="in the dependent-launch step's buckets of at most ROWS rows, the "
                         "output projection combines split attention (KernelConfig.o_combines; "
                         "0: none; default: as measured)")
    ap.add_argument("--sample-ahead", type=int, default=None, metavar="ROWS",
                    help="decode buckets of at most ROWS rows sample greedily in the forward's "
                         "graph (KernelConfig.sample_ahead; 0: none; default: the config's)")
    ap.add_argument("--variant", default=None, metavar="ITEMS",
                    help="the kernels' settings as bench.step_ab's --variant gives them: "
                         "+-joined K,N=TILE entries for the dependent-launch step's GEMMs "
                         "and FIELD=ROWS counts (default: as measured)")
    ap.add_argument("--gemm", choices=("default", "cublas"), default="default",
                    help="the decode step's GEMMs: ours where measured faster (default), "
                         "or cuBLAS everywhere")
    ap.add_argument("--out", default="docs/benchmarks.md", help="append the tables here ('' = no)")
    ap.add_argument("--plot", default="docs/benchmarks.png", help="PNG plot ('' = no)")
    args = ap.parse_args(argv)
    args.clock = Clock()
    args.streams = [int(s) for s in (args.streams or ("1,8" if args.quick else "1,8,32,64")).split(",")]
    args.peer_streams = [int(s) for s in args.peer_streams.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    for name in ("pdl_rows", "o_combines", "sample_ahead"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} is a row count (0: none), not "
                     f"{getattr(args, name)}")
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    return args


def measure_cell(backend, kind: str, streams: int, args, mask_ids, turn: int = 0) -> list[dict]:
    """The modes' runs in ``report.run_order`` (``turn``: the cell's place
    in the grid); the last run of each mode has the timing hook on.
    Returns one row per mode."""
    reqs = make_requests(kind, request_count(kind, streams, args.quick), args.tokens, mask_ids,
                         backend.vocab_size, seed=streams)
    runs = {m: [] for m in report.MODES}
    for i, mode in report.run_order(args.repeats, turn):
        hooked = i == args.repeats - 1
        r = run_closed_loop(backend, reqs, streams, ENGINE_MODE[mode], hooked)
        r["hooked"] = hooked
        runs[mode].append(r)
        args.clock.say(f"{kind} x{streams} {mode} run {i + 1}/{args.repeats}"
            f"{' (timing hook)' if hooked else ''}: {r['tok_s']:,.0f} tok/s, "
            f"{r['ms_step']:.2f} ms/step ({report.run_spans(r)})")
    rows = []
    for mode, rs in runs.items():
        hooked = rs[-1]
        row = dict(workload=kind, streams=streams, mode=mode, runs=len(rs), **report.mode_row(rs))
        for k in ("idle_ms", "busy_ms", "bookkeeping_ms"):
            row[k] = hooked.get(k)
        row["tok_s_hooked"] = hooked["tok_s"]
        ticks = row.get("ahead_ticks", 0) + row.get("behind_ticks", 0) + row.get("unweighed_ticks", 0)
        if ticks:  # how auto chose in the run the table shows
            row["note"] = (f"behind at {row['behind_ticks'] / ticks:.0%} of ticks, "
                           f"unweighed at {row.get('unweighed_ticks', 0) / ticks:.0%}")
        rows.append(row)
    return rows


def engine_cells(backend, args, mask_ids) -> list[dict]:
    rows = []
    for turn, (kind, streams) in enumerate((k, n) for k in args.workloads for n in args.streams):
        if args.clock.elapsed() > args.budget:
            err = "skipped: time budget"
            new = [dict(workload=kind, streams=streams, mode=m, error=err) for m in report.MODES]
        else:
            try:
                limit = min(args.cell_timeout, args.deadline - args.clock.elapsed())
                with time_limit(limit):
                    new = measure_cell(backend, kind, streams, args, mask_ids, turn)
            except (Exception, TimeLimit) as ex:  # noqa: BLE001 - a cell's failure is a row
                args.clock.say(f"{kind} x{streams} FAILED: {ex!r}")
                with contextlib.suppress(Exception):
                    backend.repair()
                new = [dict(workload=kind, streams=streams, mode=m, error=f"error: {ex!r}"[:200])
                       for m in report.MODES]
        for r in new:
            report.emit(r)
        rows += new
    return rows


def peer_cells(args, device) -> list[dict]:
    """The peers on the text workload and the sampled one (the same text,
    drawn as ``SAMPLED`` says), where the run has them."""
    kinds = [k for k in ("text", "sampled") if k in args.workloads]
    if not kinds:
        return []
    peers = (Peers(lambda: build_model(args.tiny, seed=1, shape=args.model)[0], device)
             if device.type == "cuda" else None)
    rows = []
    for kind in kinds:
        for streams in args.peer_streams:
            for key, name in PEER_NAMES.items():
                row = peer_cell(peers, args, kind, streams, key, name)
                report.emit(row)
                rows.append(row)
    if peers is not None:
        peers.close()
    return rows


def peer_cell(peers, args, kind: str, streams: int, key: str, name: str) -> dict:
    """One peer's row: its figures, or why it has none."""
    row = dict(workload=kind, streams=streams, mode=name)
    limit = min(args.peer_timeout, args.deadline - args.clock.elapsed())
    if peers is None:
        row["error"] = "n/a: needs CUDA"
    elif limit < 15:
        row["error"] = "skipped: time budget"
    else:
        label = f"peer {name} {kind} x{streams}"
        args.clock.say(f"{label} ...")
        try:
            with time_limit(limit):
                row.update(getattr(peers, key)(streams, PROMPT, args.tokens["text"],
                                               SAMPLED if kind == "sampled" else None))
            args.clock.say(f"{label}: {row['tok_s']:,.0f} tok/s")
        except BaseException as ex:  # noqa: BLE001 - a peer's failure is a table row
            if isinstance(ex, KeyboardInterrupt):
                raise
            args.clock.say(f"{label} FAILED: {ex!r}")
            row["error"] = f"error: {ex!r}"[:200]
    return row


def warm_up(backend, args, mask_ids) -> None:
    """Every workload once per mode, at one stream and at the most, hook on."""
    for kind, streams in ((k, n) for k in args.workloads for n in sorted({1, max(args.streams)})):
        reqs = make_requests(kind, streams, QUICK_TOKENS, mask_ids, backend.vocab_size, seed=-1)
        for pipelined in (True, False):
            try:
                with time_limit(args.cell_timeout):
                    run_closed_loop(backend, reqs, streams, pipelined, record=True)
            except (Exception, TimeLimit) as ex:  # noqa: BLE001
                args.clock.say(f"warm-up {kind} FAILED: {ex!r}")
                with contextlib.suppress(Exception):
                    backend.repair()
    args.clock.say("warm-up done")


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # a tiny model's ops only lose to thread hand-offs
    try:
        return run(args, "python -m bubblefree.bench.speed " + " ".join(sys.argv[1:] if argv is None else argv))
    finally:
        torch.set_num_threads(threads)


def decode_options(args, device, config) -> dict:
    kernels = KernelConfig.measured(device, config)
    if args.pdl_rows is not None:
        kernels = attrs.evolve(kernels, pdl_rows=args.pdl_rows)
    if args.o_combines is not None:
        kernels = attrs.evolve(kernels, o_combines=args.o_combines)
    if args.sample_ahead is not None:
        kernels = attrs.evolve(kernels, sample_ahead=args.sample_ahead)
    if args.variant:
        from bubblefree.bench.step_ab import variant
        try:
            kernels = variant(kernels, args.variant)
        except ValueError as err:
            raise SystemExit(f"bench.speed: --variant: {err}") from None
    kernels = attrs.evolve(kernels, dispatch=kernels.dispatch.forced(args.split_below,
                                                                     args.attention))
    if args.gemm == "cublas":
        kernels = attrs.evolve(kernels, tiles=TileTable())
    options = dict(DECODE_PATHS[args.decode], kernels=kernels)
    options["compile_decode"] &= device.type == "cuda"  # inductor on the CPU needs a compiler
    return options


def kernels_note(backend) -> str:
    """Our Triton kernels' settings, where they run."""
    return f" ({backend.kernels})" if backend.device.type == "cuda" else ""


def read_floor(weights: int, bytes_per_s: float, probe: str) -> dict:
    """A decode step's floor: its weights read once at the measured read bandwidth."""
    return dict(read_gbps=bytes_per_s / 1e9, probe=probe, weight_gb=weights / 1e9,
                floor_ms=weights / bytes_per_s * 1e3)


def run(args, command: str) -> str:
    model, label = build_model(args.tiny, shape=args.model)
    device = next(model.parameters()).device
    env = dict(device=(torch.cuda.get_device_name(device) if device.type == "cuda"
                       else f"CPU ({platform.processor() or platform.machine()})"),
               torch=torch.__version__, transformers=transformers.__version__, model=label)
    args.clock.say(f"{env['device']}, torch {env['torch']}, transformers {env['transformers']}")
    floor = read_floor(weight_bytes(model), *read_bandwidth(device))
    report.emit(dict(measure="floor", **floor))
    args.clock.say(f"read bandwidth {floor['read_gbps']:,.0f} GB/s ({floor['probe']}); weights "
                   f"{floor['weight_gb']:.3f} GB; read floor {floor['floor_ms']:.3f} ms/step")
    top = max(args.streams)
    t = time.perf_counter()
    try:
        backend = TimedBackend(model, page_size=16, num_pages=2 * top * math.ceil(CONTEXT / 16) + 16,
                               max_rows=top, max_seqs=max(256, 2 * top),
                               max_prefill_tokens=max(2048, PROMPT * top), max_context=CONTEXT,
                               use_graphs=device.type == "cuda",
                               **decode_options(args, device, model.config))
        env["decode"] = backend.decode_path + kernels_note(backend)
        env["prefill"] = backend.prefill_path
        args.clock.say(f"backend built in {time.perf_counter() - t:.1f} s (graphs captured); "
                       f"decode step: {backend.decode_path}; prefill: {backend.prefill_path}")
        mask_ids = tuple(Engine(backend).register_mask(m) for m in bin_masks(backend.vocab_size))
        warm_up(backend, args, mask_ids)
        rows = engine_cells(backend, args, mask_ids)
    except Exception as ex:  # noqa: BLE001 - the peers still run and the table is still written
        args.clock.say(f"backend FAILED: {ex!r}")
        rows = [dict(workload=k, streams=n, mode=m, error=f"error: backend: {ex!r}"[:200])
                for k in args.workloads for n in args.streams for m in report.MODES]
        for r in rows:
            report.emit(r)
    rows += peer_cells(args, device)

    seed_table, seed_rows = report.seed_model(rows)
    if not seed_rows:
        seed_table = "(no detect results in this run)"
    for r in seed_rows:
        report.emit(dict(measure="seed_model", **r))
    table = report.main_table(rows, floor["floor_ms"], floor["read_gbps"]) + "\n\n" + \
        report.auto_summary(rows)
    if args.out:
        notes = report.notes(args.tokens, args.repeats)
        report.append_docs(args.out, report.header(env, command, floor, notes),
                           table + "\n\nThe seed's model on the detect workload:\n\n" + seed_table)
    if args.plot:
        problem = report.plot(rows, args.plot, f"{env['device']}: tokens/s by streams")
        args.clock.say(problem or f"plot written to {args.plot}")
    report.copy_out(args.out, args.plot)
    print("\nThe seed's model on the detect workload (ms per step; blocking run's F and B):\n")
    print(seed_table)
    print("\n" + table, flush=True)
    return table


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        os._exit(0)  # a peer's worker thread that outlived its time limit must not hold the exit
