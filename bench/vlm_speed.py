"""moondream2 on images: pipelined against blocking against a transformers VLM.

    python -m bubblefree.bench.vlm_speed [--streams 1,8,32] [--sizes 378,756]
        [--workloads point,detect,caption,query] [--quick] [--out docs/benchmarks.md]

moondream2's full shape with random bf16 weights (vision 27 x 1152, text
Phi-1.5 24 x 2048, region head), through the public API
(``engine.point(image, object)`` and friends), *streams* client threads
each asking about a fresh image (never encoded before) and, once answered,
the next. Each cell runs pipelined, blocking and the per-tick choice
("auto") alternating (P B A A B P, ``--rounds`` times), so drift hits all
alike. Reported per
cell: req/s, p50 and p99 latency, auto against the better of the other
two; per image size: the image encoder on the device, per image and crop.
The peer (``vlm_peer.py``) is timed in the same run: plain ``generate``
on a LLaVA of the same shape, 3 new tokens for point-like, 10 for a query.

Workloads (greedy): point and detect with ``max_objects=1``; caption
``short`` capped at 16 tokens; query capped at 10 tokens. With random
weights the lengths are what the caps and the model's argmax make them,
the same in both modes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bubblefree.bench.doc_block import write_block
from bubblefree.bench.speed_report import AUTO_TARGET, MODES, behind_summary, run_order, timings_summary
from bubblefree.bench.vlm_peer import encoder_ms_per_crop, make_peer, time_requests

BEGIN, END = "<!-- vlm-speed:begin -->", "<!-- vlm-speed:end -->"
GREEDY = {"temperature": 0.0}
WORKLOADS = {
    "point": lambda e, image: e.point(image, "the red car", settings={**GREEDY, "max_objects": 1}),
    "detect": lambda e, image: e.detect(image, "the red car", settings={**GREEDY, "max_objects": 1}),
    "caption": lambda e, image: e.caption(image, length="short", settings={**GREEDY, "max_tokens": 16}),
    "query": lambda e, image: e.query(image, "What is in the picture?", settings={**GREEDY, "max_tokens": 10}),
}
PEER_TOKENS = {"point": 3, "detect": 4, "caption": 16, "query": 10}
TARGETS = ("point, fresh 378 px, 1 stream: p50 <= 15 ms; query (10 tokens), 1 stream: >= 50 req/s; "
           "encoder <= 2 ms per crop; pipelined >= blocking in every cell; "
           f"auto >= {AUTO_TARGET} x the better of the two in every cell")


def images(count: int, side: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(count)]


def run_cell(engine, workload: str, pictures: list[Image.Image], streams: int) -> dict:
    """``streams`` clients, closed loop, over ``pictures`` (one request each)."""
    ask = WORKLOADS[workload]
    todo = list(reversed(pictures))
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    together = threading.Barrier(streams)

    def client() -> None:
        together.wait(timeout=60)
        while True:
            with lock:
                if not todo:
                    return
                picture = todo.pop()
            start = time.perf_counter()
            try:
                ask(engine, picture)
            except Exception as err:  # noqa: BLE001 - reported in the table
                errors.append(f"{type(err).__name__}: {err}")
                return
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    latencies.sort()
    return dict(req_s=len(latencies) / wall, p50_ms=1e3 * statistics.median(latencies),
                p99_ms=1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))])


def measure(engine, workload: str, side: int, streams: int, count: int, seed: int, rounds: int = 1,
            turn: int = 0) -> dict:
    """Pipelined, blocking and the per-tick choice ("auto"), alternating
    (P B A A B P, ``rounds`` times, in the first cell; ``speed_report.
    run_order``, turned by ``turn``, the cell's place in the grid) so drift
    hits all alike; req/s is each mode's median."""
    modes: tuple = (True, False, "auto")
    engine_mode = dict(zip(MODES, modes))
    runs: dict = {mode: [] for mode in modes}
    warm = images(max(2, streams), side, seed + 7)
    engine.pipelined = True
    run_cell(engine, workload, warm, streams)  # shapes, graphs, allocator
    core, ticks = engine.core, [0, 0, 0]  # auto's ticks ahead, behind and unweighed, over its runs
    why: list = []  # the rule's inputs at auto's behind ticks (the newest the core keeps)
    for i, mode in enumerate(engine_mode[name] for _, name in run_order(2 * rounds, turn)):
        engine.pipelined = mode
        before = (core.ahead_ticks, core.behind_ticks, core.unweighed_ticks)
        runs[mode].append(run_cell(engine, workload, images(count, side, seed + i), streams))
        ticks = [ticks[0] + core.ahead_ticks - before[0], ticks[1] + core.behind_ticks - before[1],
                 ticks[2] + core.unweighed_ticks - before[2]]
        new = min(core.behind_ticks - before[1], len(core.behind))
        why += list(core.behind)[len(core.behind) - new:]
        if mode == "auto":
            timed = timings_summary(core)
    engine.pipelined = "auto"
    best = {mode: max(r, key=lambda x: x["req_s"]) for mode, r in runs.items()}
    med = {mode: statistics.median(x["req_s"] for x in r) for mode, r in runs.items()}
    return dict(workload=workload, side=side, streams=streams, requests=count,
                p_req_s=med[True], b_req_s=med[False], ratio=med[True] / med[False],
                p_p50=best[True]["p50_ms"], p_p99=best[True]["p99_ms"],
                b_p50=best[False]["p50_ms"], b_p99=best[False]["p99_ms"],
                a_req_s=med["auto"], a_vs_better=med["auto"] / max(med[True], med[False]),
                a_behind=ticks[1] / max(1, sum(ticks)), a_behind_why=behind_summary(why), a_timings=timed,
                # each run's req/s in the order run: how far a cell moves between runs
                runs={name: [x["req_s"] for x in runs[mode]] for mode, name in zip(modes, "pba")})


def encode_figures(engine, side: int, images_per_call: int = 4, reps: int = 10) -> dict:
    """The engine's image encoder on the device (crops already on it: the
    host's cropping runs on callers' threads, beside the decode loop):
    ``images_per_call`` images of ``side`` px through one ``embed`` call
    (encoder over every crop, reconstruction, projection), as an image
    prefill step batches them. Per image and per crop."""
    from bubblefree.cuda_backend.moondream.prepared import prepare

    backend = engine.backend
    prepared = [prepare(p, backend.config.vision, False) for p in images(images_per_call, side, 99)]
    crops = torch.cat([p.crops for p in prepared]).to(backend.device)
    tilings = [p.tiling for p in prepared]
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        backend.vision.embed(crops, tilings)
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            backend.vision.embed(crops, tilings)
        sync()
    ms = 1e3 * (time.perf_counter() - start) / reps
    return dict(side=side, crops=crops.shape[0] // images_per_call, image_ms=ms / images_per_call,
                crop_ms=ms / crops.shape[0])


def make_engine(device: str, quick: bool, crops_on_device: bool = True,
                torch_greedy: bool = False, torch_inputs: bool = False):
    from bubblefree import Engine
    options = {}
    if torch_greedy or torch_inputs:  # the before of a before/after
        import attrs

        from bubblefree.build import random_config
        from bubblefree.cuda_backend.kernel_config import KernelConfig
        from bubblefree.cuda_backend.moondream.text import phi_config
        text = random_config("tiny" if quick else "full").text
        options["kernels"] = attrs.evolve(KernelConfig.measured(device, phi_config(text)),
                                          greedy_kernel=not torch_greedy,
                                          step_inputs=not torch_inputs)
    return Engine.moondream_random("tiny" if quick else "full", device=device,
                                   crops_on_device=crops_on_device, **options)


def table(rows: list[dict], peer: dict[tuple[str, int], dict]) -> str:
    auto = any("a_req_s" in r for r in rows)  # runs before the per-tick choice have no auto column
    extra_head, extra_rule = (" auto req/s | auto ÷ better |", "---:|---:|") if auto else ("", "")
    out = ["| workload | image | streams | pipelined req/s | blocking req/s | P ÷ B |" + extra_head
           + " p50 / p99 ms P | p50 / p99 ms B | hf generate req/s | hf p50 ms |",
           "|---|---|---:|---:|---:|---:|" + extra_rule + "---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['side']} px | {r['streams']} | {r['error']} | | |"
                       + (" | |" if auto else "") + " | | | |")
            continue
        pr = peer.get((r["workload"], r["streams"]), {})
        peer_cells = (f"{pr['req_s']:.1f} | {pr['p50_ms']:.1f}" if "req_s" in pr
                      else f"{pr.get('error', '—')} | ")
        auto_cells = ""
        if auto:
            behind = f" (behind at {r['a_behind']:.0%} of ticks)" if "a_behind" in r else ""
            auto_cells = (f" {r['a_req_s']:.1f} | {r['a_vs_better']:.2f}{behind} |" if "a_req_s" in r
                          else " — | — |")
        out.append(f"| {r['workload']} | {r['side']} px | {r['streams']} | {r['p_req_s']:.1f} | "
                   f"{r['b_req_s']:.1f} | {r['ratio']:.2f} |{auto_cells} {r['p_p50']:.1f} / {r['p_p99']:.1f} | "
                   f"{r['b_p50']:.1f} / {r['b_p99']:.1f} | {peer_cells} |")
    return "\n".join(out)


def targets(rows: list[dict], encode: list[dict]) -> str:
    def cell(workload, side, streams):
        return next((r for r in rows if r["workload"] == workload and r["side"] == side
                     and r["streams"] == streams and "error" not in r), None)
    lines = []
    point = cell("point", 378, 1)
    if point:
        lines.append(f"- point, fresh 378 px, 1 stream: p50 {point['p_p50']:.1f} ms (target <= 15): "
                     f"{'met' if point['p_p50'] <= 15 else 'not met'}")
    query = cell("query", 378, 1)
    if query:
        lines.append(f"- query capped at 10 tokens, 378 px, 1 stream: {query['p_req_s']:.1f} req/s "
                     f"(target >= 50): {'met' if query['p_req_s'] >= 50 else 'not met'}")
    for e in encode:
        lines.append(f"- image encoder, {e['side']} px ({e['crops']} crops with the global view, 4 images a "
                     f"call): {e['image_ms']:.2f} ms per image, {e['crop_ms']:.2f} ms per crop (target <= 2): "
                     f"{'met' if e['crop_ms'] <= 2 else 'not met'}")
    ok = [r for r in rows if "error" not in r]
    losing = [r for r in ok if r["ratio"] < 1.0]
    auto = [r for r in ok if "a_vs_better" in r]
    if auto:
        short = [r for r in auto if r["a_vs_better"] < AUTO_TARGET]
        lines.append(f"- auto (the per-tick choice) >= {AUTO_TARGET} x the better of pipelined and blocking: "
                     f"{len(auto) - len(short)} of {len(auto)} cells" + ("" if not short else " (below: " + ", ".join(
                         f"{r['workload']} {r['side']} px x{r['streams']} {r['a_vs_better']:.3f}" for r in short) + ")"))
    lines.append(f"- pipelined >= blocking: {len(ok) - len(losing)} of {len(ok)} cells"
                 + ("" if not losing else " (below: " + ", ".join(
                     f"{r['workload']} {r['side']} px x{r['streams']} {r['ratio']:.2f}" for r in losing) + ")"))
    return "\n".join(lines)


def plot(rows: list[dict], peer: dict[tuple[str, int], dict], path: Path) -> str | None:
    """req/s against streams, a panel per workload and image size: pipelined,
    blocking, and the peer (one 378-px crop, so it sits in every size's panel)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as ex:  # noqa: BLE001 - the plot is optional
        return f"no plot: {ex!r}"
    good = [r for r in rows if "error" not in r]
    panels = list(dict.fromkeys((r["workload"], r["side"]) for r in good))
    if not panels:
        return "no plot: no results"
    sides = sorted({side for _, side in panels})
    workloads = list(dict.fromkeys(w for w, _ in panels))
    fig, axes = plt.subplots(len(sides), len(workloads), figsize=(4.2 * len(workloads), 3.6 * len(sides)),
                             squeeze=False)
    for i, side in enumerate(sides):
        for j, w in enumerate(workloads):
            ax = axes[i][j]
            cells = sorted((r for r in good if r["workload"] == w and r["side"] == side),
                           key=lambda r: r["streams"])
            xs = [r["streams"] for r in cells]
            ax.plot(xs, [r["p_req_s"] for r in cells], marker="o", label="pipelined")
            ax.plot(xs, [r["b_req_s"] for r in cells], marker="s", label="blocking")
            if all("a_req_s" in r for r in cells):
                ax.plot(xs, [r["a_req_s"] for r in cells], marker="d", label="auto")
            pts = [(n, peer[(w, n)]["req_s"]) for n in xs if "req_s" in peer.get((w, n), {})]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="^", label="hf generate")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_title(f"{w}, {side} px")
            ax.set_xlabel("streams")
            ax.set_ylabel("req/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return None


def render(record: dict, out: Path | None, plot_path: Path | None) -> str:
    """The doc section of one run's record (the JSON ``--record`` writes)."""
    rows, encode = record["rows"], record["encode"]
    peer = {(w, n): v for w, n, v in record["peer"]}
    crop_ms_peer = record.get("peer_crop_ms")
    text = "\n".join([
        "## moondream2 on images: pipelined, blocking, and transformers",
        "",
        f"Run {record['env']}: `{record['command']}`. "
        + ("The tiny random config (a smoke run, not a measurement)." if record["quick"] else
           "Random bf16 weights of moondream2's full shape.") + " Fresh images, greedy. "
        + ("The peer is a transformers LLaVA of the same shape (one 378-px crop) under "
           f"`generate`, one batch per cell, {PEER_TOKENS} new tokens." if peer else
           "The peer did not run in this call.")
        + (f" Its vision tower: {crop_ms_peer:.2f} ms per crop, batched." if crop_ms_peer else ""),
        "",
        table(rows, peer),
        "",
        "Targets (" + TARGETS + "):",
        "",
        targets(rows, encode),
    ])
    if plot_path is not None:
        note = plot(rows, peer, plot_path)
        text += "\n\n" + (note or f"![moondream2 req/s]({plot_path.name})")
    if out is not None:
        write_block(out, BEGIN, END, text)
    return text


def grid(engine, args, sizes: list[int], workloads: list[str], streams: list[int], over_budget) -> list[dict]:
    """Every cell of the grid, in order (each cell's runs in its own turn of
    ``run_order``); a cell that fails or is past the budget says why."""
    rows: list[dict] = []
    for side in sizes:
        for workload in workloads:
            for n in streams:
                count = args.per_stream * n + 16
                if over_budget():
                    rows.append(dict(workload=workload, side=side, streams=n, error="skipped: time budget"))
                    print(rows[-1], flush=True)
                    continue
                try:
                    rows.append(measure(engine, workload, side, n, count, seed=side * 1000 + n,
                                        rounds=args.rounds, turn=len(rows)))
                except Exception as err:  # noqa: BLE001 - the cell says why
                    rows.append(dict(workload=workload, side=side, streams=n, error=f"{type(err).__name__}: {err}"))
                print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--sizes", default="378,756")
    ap.add_argument("--workloads", default="point,detect,caption,query")
    ap.add_argument("--quick", action="store_true", help="the tiny random config (a CPU smoke run)")
    ap.add_argument("--per-stream", type=int, default=6, help="requests per run: per-stream x streams + 16")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times each cell runs P B A A B P (2 x rounds runs per mode, the median kept)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--crops-on-host", action="store_true",
                    help="callers' images resized and cut by Pillow on their threads, not on the GPU "
                    "(MoondreamBackend's crops_on_device=False)")
    ap.add_argument("--torch-greedy", action="store_true",
                    help="greedy sampling in torch's kernels, not greedy_sample's one")
    ap.add_argument("--torch-inputs", action="store_true",
                    help="a decode step's inputs gathered by torch's kernels, not step_inputs' one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the table into this markdown file (and the plot beside it)")
    ap.add_argument("--record", default=None, help="write the run's figures as JSON here")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="start no new cell (nor the peer) after this many seconds: the cells left are "
                         "listed as skipped and the table is still written (default: no bound). A call "
                         "under a time limit then keeps its table")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="SECONDS",
                    help="the interpreter's thread switch interval for the run (sys.setswitchinterval; "
                         "default: Python's, 0.005): how long a caller's thread may hold the "
                         "interpreter before the decode loop's gets it back")
    args = ap.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    workloads = args.workloads.split(",")
    if args.rounds < 1:
        ap.error(f"--rounds: must be at least 1, got {args.rounds}")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.budget is not None and not args.budget >= 0:
        ap.error(f"--budget: seconds, at least 0, got {args.budget}")
    if args.switch_interval is not None and not 0 < args.switch_interval < 1:
        ap.error(f"--switch-interval: seconds, above 0 and below 1, got {args.switch_interval}")
    started = time.monotonic()

    def over_budget() -> bool:
        return args.budget is not None and time.monotonic() - started > args.budget

    engine = make_engine(args.device, args.quick, not args.crops_on_host, args.torch_greedy,
                         args.torch_inputs)
    interval = sys.getswitchinterval()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    try:
        rows = grid(engine, args, sizes, workloads, streams, over_budget)
    finally:
        sys.setswitchinterval(interval)
    encode = [encode_figures(engine, side) for side in sizes]
    engine.close()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    peer: dict[tuple[str, int], dict] = {}
    if not args.no_peer and over_budget():
        peer = {(w, n): dict(error="skipped: time budget") for w in workloads for n in streams}
        crop_ms_peer = None
    elif not args.no_peer:
        device = torch.device(args.device)
        model = make_peer(device)
        try:
            crop_ms_peer = encoder_ms_per_crop(model, device)
        except Exception as err:  # noqa: BLE001
            crop_ms_peer = None
            print("peer encoder:", err, flush=True)
        for workload in workloads:
            for n in streams:
                try:
                    peer[(workload, n)] = time_requests(model, device, n, PEER_TOKENS[workload])
                except Exception as err:  # noqa: BLE001
                    peer[(workload, n)] = dict(error=type(err).__name__)
        del model
    else:
        crop_ms_peer = None

    env = (f"{torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine()}, "
           f"torch {torch.__version__}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")
    command = "python -m bubblefree.bench.vlm_speed " + " ".join(argv if argv is not None else sys.argv[1:])
    record = dict(env=env, command=command.strip(), quick=args.quick, rows=rows, encode=encode,
                  peer=[[w, n, v] for (w, n), v in peer.items()], peer_crop_ms=crop_ms_peer)
    if args.record:
        Path(args.record).write_text(json.dumps(record, indent=1))
    out = Path(args.out) if args.out else None
    text = render(record, out, out.with_name("benchmarks-vlm.png") if out else None)
    print(text)
    return text


if __name__ == "__main__":
    main()
