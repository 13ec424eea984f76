"""Times the paged decode attention kernels at the benchmark model's
attention shape (32 heads of 64, pages of 16, bf16) inside CUDA graphs, as
the engine runs them: a graph of 20 launches is replayed, so a kernel
shorter than a host launch is timed as itself, not as the launch; each
launch reads pages the previous ones did not, so L2 does not flatter small
cases. A whole step still differs (its GEMMs run in between): decide from
``bench.profile_step``, which times whole steps per launch.

Every one-pass launch (``kernel_config.Launch``: heads per program, keys per
iteration, warps, loop stages) in the grid, and the split kernel, at each
(rows, context); then the best launch per case, and the current default.

    python -m bubblefree.bench.attention_tune [--rows 1,8,32,64] [--contexts 128,512]
                                   [--launches 1x32w2s1,4x32w4s1]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from bubblefree.cuda_backend import paged_decode as pd
from bubblefree.cuda_backend.kernel_config import Dispatch, Launch

HEADS, DIM, PS = 32, 64, 16
L2_BYTES = 50 * 2**20  # the H200's


def grid() -> list[Launch]:
    """Launches whose key and value tiles stay within ~128 float32 registers
    per thread each (heads * keys * 64 dims over 32 * warps threads)."""
    out = []
    for heads, block_n, warps, stages in itertools.product((1, 2), (16, 32, 64),
                                                            (1, 2, 4), (1, 3)):
        if heads * block_n * DIM <= 128 * 32 * warps:
            out.append(Launch(heads, block_n, warps, stages))
    return out


def case(rows: int, context: int):
    """Tensors of one decode step's attention, every row at ``context``, and
    page tables over disjoint pages of a pool of at least 3 L2s: successive
    calls take successive tables, so (as in a step, where the layers'
    weights pass through L2 in between) keys are not already in L2."""
    pages = -(-(context + 1) // PS)
    need = rows * pages
    pool = max(2 * need, -(-3 * L2_BYTES // (PS * HEADS * DIM * 2 * 2)))
    keys = torch.randn(pool * PS, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    order = torch.randperm(pool, device="cuda")
    tables = [order[i:i + need].view(rows, pages) for i in range(0, pool - need + 1, need)]
    positions = torch.full((rows,), context, device="cuda")
    q = torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return q, keys, values, tables, positions, torch.empty_like(q)


def time_in_graph(fn, reps: int = 20, replays: int = 10) -> float:
    """Microseconds per call of ``fn`` replayed from a graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * replays) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--launches", default="", help="one-pass launches to time (default: a grid)")
    args = ap.parse_args(argv)
    launches = [Launch.parse(x) for x in args.launches.split(",") if x] or grid()
    default = Dispatch()
    scale = DIM ** -0.5
    results: dict[tuple[int, int], dict[str, float]] = {}
    print("| rows | context | kernel | us per call | TB/s |")
    print("|---:|---:|---|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        for context in map(int, args.contexts.split(",")):
            q, keys, values, tables, positions, out = case(rows, context)
            kv_bytes = rows * (context + 1) * HEADS * DIM * 2 * 2
            timed = results.setdefault((rows, context), {})
            turn = itertools.cycle(tables)
            calls = {str(x): (lambda x=x: pd.one_pass(q, keys, values, next(turn), positions, PS,
                                                       scale, pd.NO_WINDOW, out, x))
                     for x in launches}
            calls["split"] = lambda: pd.split_attention(q, keys, values, next(turn), positions,
                                                        PS, scale, pd.NO_WINDOW, out)
            for name, fn in calls.items():
                try:
                    us = timed[name] = time_in_graph(fn)
                except Exception as ex:  # noqa: BLE001 - e.g. a tile past shared memory
                    timed[name] = float("inf")
                    print(f"| {rows} | {context} | {name} | failed: {type(ex).__name__} | |")
                    continue
                print(f"| {rows} | {context} | {name} | {us:.2f} | {kv_bytes / us / 1e6:.2f} |",
                      flush=True)
    print(f"\nbest per case, against what the default dispatch runs ({default}):")
    print("| rows | context | best | us | dispatch | us | split us |")
    print("|---:|---:|---|---:|---|---:|---:|")
    for (rows, context), timed in results.items():
        best = min(timed, key=timed.get)
        chosen = default.choose(rows, HEADS, -(-(context + 1) // PS) * PS)
        chosen = "split" if chosen is None else str(chosen)
        print(f"| {rows} | {context} | {best} | {timed[best]:.2f} | {chosen} | "
              f"{timed.get(chosen, float('nan')):.2f} | {timed['split']:.2f} |")
    names = [str(x) for x in launches]
    # Cases differ in size: rank launches by time over the case's best.
    relative = {n: sum(t[n] / min(t.values()) for t in results.values()) / len(results)
                for n in names}
    ranked = sorted(names, key=relative.get)
    print(f"\nleast time relative to each case's best, on average: {ranked[0]} "
          f"({relative[ranked[0]]:.3f})")
    # What to time in a whole step (bench.profile_step): that, and the best
    # launch of each row count at the shortest context; four at most.
    short = min(c for _, c in results)
    best = [min(names, key=t.get) for (_, c), t in results.items() if c == short]
    print("top: " + ",".join(list(dict.fromkeys(ranked[:1] + best))[:4]))


if __name__ == "__main__":
    main()
