"""Through the serving layer against the core driven directly: same batching?

    python -m bubblefree.bench.api_speed [--tiny] [--quick] [--streams 1,8,32]

The same backend object and the same requests run two ways, alternating:

    core    one thread ticks ``core.Engine`` and submits the next request the
            moment one ends (``speed_cells.run_closed_loop``, as in bench.speed)
    served  ``bubblefree``'s serving layer: the decode thread, its inbox, and
            *streams* client threads, each submitting a request and blocking
            on its ``Handle`` until the result, then the next

Each row gives tokens/s, decode rows per step (from the core's trace), and
whether both produced the same tokens (I8). The serving layer should batch
like the core: the same rows per step and throughput within a few percent.
The table is printed and, with ``--out``, written into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import math
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import transformers

from bubblefree.bench.doc_block import write_block
from bubblefree.bench.speed_cells import (FULL_TOKENS, PROMPT, QUICK_TOKENS, TimedBackend, bin_masks,
                                           make_requests, run_closed_loop)
from bubblefree.bench.speed_setup import build_model
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import Status
from bubblefree.loop import ServingLoop

CONTEXT = 256
BEGIN, END = "<!-- api-speed:begin -->", "<!-- api-speed:end -->"


def decode_rows(launches: list[tuple[str, int]]) -> float:
    """Mean rows of the decode steps among ``(kind, rows)`` launches."""
    rows = [n for kind, n in launches if kind == "decode"]
    return statistics.mean(rows) if rows else 0.0


def run_served(backend, requests, streams: int) -> dict:
    """``streams`` client threads, each blocking on one request at a time."""
    core = CoreEngine(backend, pipelined=True)
    for allowed in list(backend._mask_ids):  # the backend hands back the ids it already has
        core.register_mask(allowed)
    loop = ServingLoop(core)
    todo = collections.deque(enumerate(requests))
    results, by_index, lock = [], {}, threading.Lock()
    together = threading.Barrier(streams)  # the first requests are submitted at once

    def client():
        together.wait(timeout=60)
        while True:
            with lock:
                if not todo:
                    return
                index, req = todo.popleft()
            result = loop.submit(req).result(timeout=600)
            with lock:
                results.append(result)
                by_index[index] = result.tokens

    threads = [threading.Thread(target=client, name=f"client-{i}") for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    wall = time.perf_counter() - start
    loop.close()
    bad = [r for r in results if r.status is not Status.COMPLETED]
    if bad or len(results) != len(requests):
        raise RuntimeError(f"{len(requests) - len(results)} lost, {len(bad)} not completed")
    tokens = sum(len(r.tokens) for r in results)
    return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall,
                tokens_by_request=[by_index[i] for i in range(len(requests))])


def measure(backend, kind: str, streams: int, count: int, tokens: dict, mask_ids, repeats: int) -> dict:
    reqs = make_requests(kind, count, tokens, mask_ids, backend.vocab_size, seed=streams)
    runs: dict[str, list[dict]] = {"core": [], "served": []}
    for i in range(repeats):
        for way in (("core", "served") if i % 2 == 0 else ("served", "core")):
            start = len(backend.launch_log)
            r = (run_closed_loop(backend, reqs, streams, pipelined=True, record=False) if way == "core"
                 else run_served(backend, reqs, streams))
            r["rows"] = decode_rows(backend.launch_log[start:])
            runs[way].append(r)
    core_runs, served_runs = runs["core"], runs["served"]
    core = statistics.median(r["tok_s"] for r in core_runs)
    served = statistics.median(r["tok_s"] for r in served_runs)
    return dict(workload=kind, streams=streams, requests=count,
                core_tok_s=core, served_tok_s=served, ratio=served / core,
                core_rows=statistics.mean(r["rows"] for r in core_runs),
                served_rows=statistics.mean(r["rows"] for r in served_runs),
                same=_same_requests(core_runs + served_runs))


def _same_requests(runs: list[dict]) -> tuple[int, int]:
    """(requests whose tokens were the same in every run, requests). On a GPU
    in bf16 a different batch composition may pick another GEMM kernel and
    flip a near-tie argmax of a random model; on the CPU in fp32 all agree."""
    first = runs[0]["tokens_by_request"]
    same = sum(all(r["tokens_by_request"][i] == first[i] for r in runs) for i in range(len(first)))
    return same, len(first)


class LoggedBackend(TimedBackend):
    """Records (kind, rows) of every launch, for rows per step either way."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launch_log: list[tuple[str, int]] = []

    def launch(self, slot, plan) -> None:
        super().launch(slot, plan)
        self.launch_log.append((plan.kind.value, len(plan.rows)))


def table(rows: list[dict]) -> str:
    out = ["| workload | streams | requests | core tok/s | served tok/s | served ÷ core | "
           "rows/step core | rows/step served | same tokens every run |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['streams']} | | {r['error']} | | | | | |")
            continue
        out.append(f"| {r['workload']} | {r['streams']} | {r['requests']} | {r['core_tok_s']:,.0f} | "
                   f"{r['served_tok_s']:,.0f} | {r['ratio']:.3f} | {r['core_rows']:.2f} | "
                   f"{r['served_rows']:.2f} | {r['same'][0]}/{r['same'][1]} |")
    return "\n".join(out)


def write_doc(path: Path, text: str) -> None:
    write_block(path, BEGIN, END, text)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m bubblefree.bench.api_speed",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU")
    ap.add_argument("--quick", action="store_true", help="short outputs, few requests")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--workloads", default="text,detect")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/benchmarks.md", help="'' writes nothing")
    args = ap.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    if args.tiny:
        torch.set_num_threads(1)  # a tiny model's ops only lose to thread hand-offs
    model, label = build_model(args.tiny)
    device = next(model.parameters()).device
    top = max(streams)
    backend = LoggedBackend(model, page_size=16, num_pages=2 * top * math.ceil(CONTEXT / 16) + 16,
                            max_rows=top, max_seqs=max(64, 2 * top), max_prefill_tokens=max(512, PROMPT * top),
                            max_context=CONTEXT, use_graphs=device.type == "cuda",
                            compile_decode=device.type == "cuda")
    mask_ids = tuple(CoreEngine(backend).register_mask(m) for m in bin_masks(backend.vocab_size))
    rows = []
    for kind in args.workloads.split(","):
        for n in streams:
            count = max(2 * n, 4) if not args.quick else max(n, 2)
            try:
                measure(backend, kind, n, min(count, 8), tokens, mask_ids, 1)  # warm-up
                row = measure(backend, kind, n, count, tokens, mask_ids, args.repeats)
            except Exception as ex:  # noqa: BLE001 - a cell's failure is a row
                row = dict(workload=kind, streams=n, error=f"error: {ex!r}"[:160])
            print(row, flush=True)
            rows.append(row)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()})"
    command = "python -m bubblefree.bench.api_speed " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (f"## Through the serving layer, {datetime.date.today()}\n\n"
            f"Device: {device_name}; torch {torch.__version__}, transformers {transformers.__version__}; "
            f"{label}. Command: `{command.strip()}`. Pipelined; the same backend and requests both "
            f"ways, alternating, median of {args.repeats}. *core*: one thread ticks the core and "
            "submits the next request as one ends; *served*: the decode thread with *streams* "
            "client threads blocking on their Handles. Rows/step: decode rows per launched decode "
            "step.\n\n" + table(rows) + "\n")
    print(text)
    if args.out:
        write_doc(Path(args.out), text)
    return text


if __name__ == "__main__":
    main()
