"""Where an image request's time goes: host preparation, step kinds and
their rows, and the top device and host ops under torch's profiler.

    python -m bubblefree.bench.vlm_profile [--streams 1,16] [--requests 12] [--side 378]

moondream2's full shape, random bf16 (``--tiny`` for a CPU smoke run).
Point requests on fresh images, pipelined; a profiler table per stream
count. Read beside ``bench.vlm_speed``'s table.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time

import torch

from bubblefree.bench.vlm_speed import WORKLOADS, images


def host_prepare_ms(engine, side: int, reps: int = 10) -> float:
    """``load_image`` and the backend's crops: the caller thread's share."""
    from bubblefree.images import load_image

    pictures = images(reps, side, 5)
    start = time.perf_counter()
    for p in pictures:
        engine.backend.image_ref(load_image(p))
    return 1e3 * (time.perf_counter() - start) / reps


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--side", type=int, default=378)
    ap.add_argument("--workload", default="point", choices=sorted(WORKLOADS))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    from bubblefree import Engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine.moondream_random("tiny" if args.tiny else "full", device=device)
    print(f"host: load_image + image_ref ({args.side} px): {host_prepare_ms(engine, args.side):.2f} ms", flush=True)
    backend = engine.backend
    launches: list[tuple[str, int, float]] = []
    original = backend.launch

    def logged(slot, plan):
        t = time.perf_counter()
        original(slot, plan)
        launches.append((plan.kind.value, len(plan.rows), 1e3 * (time.perf_counter() - t)))
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
                  f"host launch call mean {statistics.mean(m for _, m in items):.2f} ms", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run(engine, args.workload, args.side, n, max(4, n))
        key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12,
                                        max_name_column_width=60), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
