"""What each kernel of a captured decode step adds to its time.

Under dependent launches (``pdl_step``) a kernel starts before the one
before it ends, so the profiler's kernel durations overlap and their sum
says little. What a kernel costs the step is how much later it ends than
the kernel before it: its *increment*. This replays the decode graph of
one bucket under the profiler and prints, for each kernel of a layer, its
duration and increment (the medians over the layers), then the kernels
before the first layer and after the last (the final norm, the head), and
the step's span, which the increments sum to.

    python -m bubblefree.bench.step_increments [--model phi|llama1b|qwen05b]
                                  [--rows 1] [--context 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import attrs
import torch

from bubblefree.bench.profile_step import time_graph
from bubblefree.bench.speed_setup import SHAPES, build_model
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.graphs import batch_buckets, bucket


@attrs.frozen
class Kernel:
    name: str
    grid: tuple[int, ...]
    start: float  # us
    dur: float  # us

    @property
    def end(self) -> float:
        return self.start + self.dur


def one_step(trace: list[dict], steps: int) -> list[Kernel]:
    """The middle one of ``steps`` replays' kernels, in the order they end."""
    kernels = sorted((Kernel(e["name"], tuple(e.get("args", {}).get("grid", ())), e["ts"], e["dur"])
                      for e in trace if e.get("cat") == "kernel" and "dur" in e),
                     key=lambda k: k.start)
    if not kernels or len(kernels) % steps:
        raise RuntimeError(f"step_increments: {len(kernels)} kernels in {steps} replays")
    n = len(kernels) // steps
    return sorted(kernels[n * (steps // 2):n * (steps // 2 + 1)], key=lambda k: k.end)


def increments(step: list[Kernel]) -> list[float]:
    """How much later each kernel ends than the one before (the first: its
    duration): they sum to the step's span."""
    return [k.end - (step[i - 1].end if i else k.start) for i, k in enumerate(step)]


ATTENTION = ("split_kernel", "one_pass_kernel")  # one a layer


def layout(step: list[Kernel], layers: int) -> tuple[int, int]:
    """``(first, per)``: where the first layer starts and how many kernels a
    layer runs. The attention kernels (one a layer) give the count; the
    final norm, the last norm kernel, is where the layers end (a layer may
    run a norm kernel or two, or none where its GEMMs norm their input)."""
    attn = [i for i, k in enumerate(step) if k.name in ATTENTION]
    norms = [i for i, k in enumerate(step) if "norm" in k.name]
    if len(attn) != layers or not norms or norms[-1] < attn[-1]:
        raise RuntimeError(f"step_increments: {len(attn)} attention kernels and "
                           f"{len(norms)} norm kernels for {layers} layers")
    if layers > 1:
        per = attn[1] - attn[0]
    else:  # one layer: it starts at its norm, or right after the step's inputs
        per = norms[-1] - (norms[0] if len(norms) > 1 else min(1, attn[0]))
    first = norms[-1] - per * layers
    names = [[k.name for k in step[first + per * i:first + per * (i + 1)]]
             for i in range(layers)] if first >= 0 else []
    if (any(b - a != per for a, b in zip(attn, attn[1:])) or not 0 <= first <= attn[0]
            or attn[0] >= first + per or any(n != names[0] for n in names)):
        raise RuntimeError("step_increments: the layers do not run the same kernels")
    return first, per


def table(step: list[Kernel], layers: int) -> str:
    inc = increments(step)
    first, per = layout(step, layers)
    rows = ["| where | kernel | grid | duration us | increment us | x count = us |",
            "|---|---|---|---:|---:|---:|"]

    def row(where, i, count=1, durs=None, incs=None):
        d = statistics.median(durs) if durs else step[i].dur
        n = statistics.median(incs) if incs else inc[i]
        grid = "x".join(map(str, step[i].grid))
        rows.append(f"| {where} | {step[i].name} | {grid} | {d:.1f} | {n:.1f} | {n * count:.0f} |")

    for i in range(first):
        row("before the layers", i)
    mid = first + per * (layers // 2)
    for j in range(per):
        at = [first + per * layer + j for layer in range(layers)]
        row(f"layer, kernel {j + 1}", mid + j, layers, [step[i].dur for i in at], [inc[i] for i in at])
    for i in range(first + per * layers, len(step)):
        row("after the layers", i)
    span = step[-1].end - step[0].start
    rows.append(f"\nspan {span:.1f} us; layers {sum(inc[first:first + per * layers]):.1f} us "
                f"({sum(inc[first:first + per * layers]) / layers:.1f} a layer); "
                f"{len(step)} kernels")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="phi")
    ap.add_argument("--rows", type=int, default=1, help="a decode bucket's rows (1, 2, 4, 8, "
                    "then steps of 16 up to 64)")
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args(argv)
    if args.rows not in batch_buckets(64):
        ap.error(f"--rows must be a decode bucket, one of {batch_buckets(64)}, not {args.rows}")
    if args.context < 1:
        ap.error(f"--context must be at least 1, not {args.context}")
    model, label = build_model(False, shape=args.model)
    be = CudaBackend(model, page_size=16, num_pages=8192, max_rows=64, max_seqs=64,
                     max_prefill_tokens=2048, max_context=max(256, 1 << args.context.bit_length()),
                     compile_decode=True)
    print(f"{label}\n{report(be, model.config.num_hidden_layers, args.rows, args.context)}")


def report(be: CudaBackend, layers: int, b: int, context: int, steps: int = 5) -> str:
    """The step's time at ``b`` rows and ``context`` (graph, events) and
    its increments' table, from ``steps`` replays under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    p = bucket(context // be.capacity.page_size + 1, be._pages)
    ms = time_graph(be, b, p, context)
    r = be._runner
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.no_grad(), torch.cuda.stream(be._compute):
            for _ in range(steps):
                be._decode_graphs.run((b, p), lambda: r.decode_forward(b, p))
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as written:
            trace = json.load(written)["traceEvents"]
    return (f"'{be.decode_path}', {b} rows, context {context}: {ms:.3f} ms a step (graph, "
            f"events)\n\n{table(one_step(trace, steps), layers)}")

if __name__ == "__main__":
    main()
