"""Where an image request's time goes: host preparation, step kinds and
their rows, and the top device and host ops under torch's profiler.

    python -m bubblefree.bench.vlm_profile [--streams 1,16] [--requests 12] [--side 378]
        [--eager-prefill] [--workload query] [--timeline] [--torch-greedy] [--torch-inputs]

moondream2's full shape, random bf16 (``--tiny`` for a CPU smoke run).
Point requests on fresh images, pipelined; a profiler table per stream
count, and per step kind the host time of a ``launch`` call and what it
launches (kernels, graph replays, copies, torch ops). ``--eager-prefill``
runs the image prefill without its graphs (``prefill_graphs=False``), the
before of a before/after. ``--timeline`` adds, per stream count, what the
device runs between two decode forwards (``step_gaps``): a step's cost
beyond its graph. Read beside ``bench.vlm_speed``'s table.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import statistics
import threading
import time

import attrs
import torch

from bubblefree.bench.step_gaps import format_report, profiled
from bubblefree.bench.vlm_speed import WORKLOADS, images


def host_prepare_ms(engine, side: int, reps: int = 10) -> float:
    """``load_image`` and the backend's crops: the caller thread's share."""
    from bubblefree.images import load_image

    pictures = images(reps, side, 5)
    start = time.perf_counter()
    for p in pictures:
        engine.backend.image_ref(load_image(p))
    return 1e3 * (time.perf_counter() - start) / reps


RANGE = "bubblefree.launch/"
# Host calls that put work on the device: what an eager step pays per kernel.
LAUNCH_CALLS = {"cudaLaunchKernel": "kernels", "cudaLaunchKernelExC": "kernels",
                "cuLaunchKernel": "kernels", "cuLaunchKernelEx": "kernels",
                "cudaGraphLaunch": "graph replays", "cudaMemcpyAsync": "copies",
                "cudaMemsetAsync": "copies"}


def launch_calls(events) -> dict[str, dict[str, float]]:
    """Per step kind, the mean count per ``launch`` of device-launch calls
    (by ``LAUNCH_CALLS`` group) and of torch ops, from a profile's events.
    A call counts when it lies inside a launch's time range: only the decode
    thread launches device work (callers' threads crop on the CPU), so any
    thread's calls are taken; torch ops only on the launch's own thread."""
    ranges = [e for e in events if e.name.startswith(RANGE)]
    calls = sorted((e.time_range.start, e.time_range.end, LAUNCH_CALLS[e.name]) for e in events
                   if e.name in LAUNCH_CALLS)
    ops = sorted((e.time_range.start, e.time_range.end, e.thread) for e in events
                 if e.name.startswith("aten::"))
    starts, op_starts = [c[0] for c in calls], [o[0] for o in ops]
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in ranges:
        kind, (t0, t1) = r.name[len(RANGE):], (r.time_range.start, r.time_range.end)
        totals[kind]["launches"] += 1
        for start, end, group in calls[bisect.bisect_left(starts, t0):]:
            if start > t1:
                break
            totals[kind][group] += end <= t1
        for start, end, thread in ops[bisect.bisect_left(op_starts, t0):]:
            if start > t1:
                break
            totals[kind]["torch ops"] += end <= t1 and thread == r.thread
    return {kind: {k: v / c["launches"] for k, v in c.items() if k != "launches"}
            for kind, c in totals.items()}


GROUPS = ("kernels", "graph replays", "copies", "torch ops")  # torch ops: nested ones too


def describe(calls: dict[str, float]) -> str:
    return ", ".join(f"{calls.get(g, 0.0):.1f} {g}" for g in GROUPS)


def run(engine, workload: str, side: int, streams: int, count: int) -> float:
    ask = WORKLOADS[workload]
    todo = images(count, side, streams)
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            ask(engine, p)

    threads = [threading.Thread(target=client) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def timeline(engine, args, streams: int, activities):
    """One profiled run's device trace, read by ``step_gaps``."""
    return profiled(lambda: run(engine, args.workload, args.side, streams, max(4, streams)),
                    activities)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--side", type=int, default=378)
    ap.add_argument("--workload", default="point", choices=sorted(WORKLOADS))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--eager-prefill", action="store_true")
    ap.add_argument("--torch-prefill-store", action="store_true",
                    help="a prefill's rotary, KV write and activation in torch, not rope_store")
    ap.add_argument("--torch-greedy", action="store_true",
                    help="greedy sampling in torch's kernels, not greedy_sample's one")
    ap.add_argument("--torch-inputs", action="store_true",
                    help="a decode step's inputs gathered by torch's kernels, not step_inputs' one")
    ap.add_argument("--timeline", action="store_true",
                    help="what the device runs between two decode forwards (step_gaps)")
    args = ap.parse_args(argv)
    from bubblefree import Engine
    from bubblefree.build import random_config
    from bubblefree.cuda_backend.kernel_config import KernelConfig
    from bubblefree.cuda_backend.moondream.text import phi_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = random_config("tiny" if args.tiny else "full")
    kernels = KernelConfig.measured(device, phi_config(config.text))  # its decoder is a Phi
    engine = Engine.moondream_random(config, device=device,
                                     prefill_graphs=not args.eager_prefill,
                                     kernels=attrs.evolve(kernels,
                                                          prefill_store=not args.torch_prefill_store,
                                                          greedy_kernel=not args.torch_greedy,
                                                          step_inputs=not args.torch_inputs))
    print(f"kernels: {engine.backend.kernels}", flush=True)
    print(f"prefill: {engine.backend.prefill_path}", flush=True)
    print(f"host: load_image + image_ref ({args.side} px): {host_prepare_ms(engine, args.side):.2f} ms", flush=True)
    backend = engine.backend
    launches: list[tuple[str, int, float]] = []
    original = backend.launch

    counted: list[dict] = []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def logged(slot, plan):
        if count_now.is_set():
            # A profiler of its own, started on this (the decode) thread: the
            # profiler records the torch ops of the thread that starts it.
            with torch.profiler.profile(activities=activities) as prof:
                with torch.profiler.record_function(RANGE + plan.kind.value):
                    original(slot, plan)
            counted.append(launch_calls(prof.events()))
            return
        t = time.perf_counter()
        original(slot, plan)
        launches.append((plan.kind.value, len(plan.rows), 1e3 * (time.perf_counter() - t)))
    count_now = threading.Event()
    with torch.profiler.profile(activities=activities):
        pass  # the profiler's first start on this thread, where it was registered
    backend.launch = logged
    for n in (int(s) for s in args.streams.split(",")):
        run(engine, args.workload, args.side, n, max(4, n))  # warm
        launches.clear()
        wall = run(engine, args.workload, args.side, n, args.requests * max(1, n // 4))
        by_kind = collections.defaultdict(list)
        for kind, rows, ms in launches:
            by_kind[kind].append((rows, ms))
        print(f"\n== {args.workload} {args.side} px, {n} streams: {args.requests * max(1, n // 4)} requests in "
              f"{wall * 1e3:.0f} ms", flush=True)
        for kind, items in by_kind.items():
            print(f"  {kind}: {len(items)} launches, rows mean {statistics.mean(r for r, _ in items):.2f}, "
                  f"host ms per launch call mean {statistics.mean(m for _, m in items):.2f}", flush=True)
        counted.clear()
        count_now.set()
        run(engine, args.workload, args.side, n, max(2, n // 4))  # slow: a profiler per launch
        count_now.clear()
        by_kind = collections.defaultdict(list)
        for one in counted:
            for kind, calls in one.items():
                by_kind[kind].append(calls)
        for kind, items in by_kind.items():
            mean = {g: statistics.mean(c.get(g, 0.0) for c in items) for g in GROUPS}
            print(f"  {kind}: per launch call, {describe(mean)}", flush=True)
        with torch.profiler.profile(activities=activities) as prof:
            run(engine, args.workload, args.side, n, max(4, n))
        key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=32, max_name_column_width=90), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                        max_name_column_width=60), flush=True)
        if args.timeline and device == "cuda":
            print(f"\n-- between decode forwards, {n} streams", flush=True)
            print(format_report(timeline(engine, args, n, activities)), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
