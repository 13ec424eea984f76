"""CPU cost of the core's bookkeeping per decode step — the cost that
pipelining hides under the next forward.

Runs the real core against a zero-cost GPU (every backend call returns at
once) and times only the core: each backend call is timed and subtracted.
Reports microseconds of scheduler work per decode step and per
sequence-step at 1, 8, 32 and 64 streams, pipelined, blocking and auto
(the per-tick choice adds its own host work), then the CUDA backend's
host packing of a decode step (``pack_decode``, ``pack_sampling``: numpy
on the host, timed on any machine) at the same row counts; writes the
tables to docs/bookkeeping.md.

    python -m bubblefree.bench.bookkeeping [--tokens 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
import timeit
from pathlib import Path

from bubblefree.core import Capacity, Engine, Request, StepKind, StepOutput
from bubblefree.core.values import GREEDY, StepPlan, StepRow

STREAMS = (1, 8, 32, 64)
# Engine.pipelined values and their names; auto's per-tick choice
# (core/ahead.py) is host work of its own, measured beside the other two.
MODES = ((True, "pipelined"), (False, "blocking"), ("auto", "auto"))


class ZeroCostGPU:
    """A backend whose every call is free: tokens are a fixed function of the
    row, so the core's work is all that is left to time."""

    def __init__(self, max_rows: int):
        self.capacity = Capacity(num_pages=8192, page_size=16, max_rows=max_rows,
                                 max_seqs=max_rows, max_prefill_tokens=64 * max_rows,
                                 max_context=4096)
        self.vocab_size = 32000
        self.spent = 0.0  # seconds inside backend calls, subtracted from the total
        self._plans: dict[int, tuple] = {}

    def register_mask(self, allowed):
        return 0

    def launch(self, slot, plan):
        t = time.perf_counter()
        self._plans[slot] = (plan.step_id, len(plan.rows))
        self.spent += time.perf_counter() - t

    def finalize(self, slot, sample):
        pass

    def wait(self, slot):
        t = time.perf_counter()
        step_id, n = self._plans[slot]
        out = StepOutput(step_id, (7,) * n)
        self.spent += time.perf_counter() - t
        return out

    def release(self, slot):
        del self._plans[slot]


def measure(streams: int, tokens: int, pipelined: bool | str) -> tuple[float, float]:
    """Returns (µs per decode step, µs per sequence-step) of core work."""
    gpu = ZeroCostGPU(max_rows=streams)
    engine = Engine(gpu, pipelined=pipelined)
    for i in range(streams):
        engine.submit(Request(prompt=tuple(range(1, 33)), max_tokens=tokens, stop_ids={0}))
    # Count decode steps from the trace afterwards; time the whole drain.
    gpu.spent = 0.0
    t = time.perf_counter()
    engine.run_until_idle()
    total = time.perf_counter() - t - gpu.spent
    decode_steps = sum(1 for e in engine.trace if e[0] == "launch" and e[2] == StepKind.DECODE.value)
    seq_steps = sum(len(e[4]) for e in engine.trace
                    if e[0] == "launch" and e[2] == StepKind.DECODE.value)
    return total / decode_steps * 1e6, total / seq_steps * 1e6


def packing(rows: int, repeats: int) -> tuple[float, float, float]:
    """µs per decode step of ``rows`` rows (12 pages each, greedy,
    unconstrained) in the CUDA backend's host packing: ``pack_decode`` and
    ``pack_sampling``; and per prefill step of ``rows`` prompts of 32 tokens
    (3 pages each) run as token rows (``TokenPrefill.pack``); the best of
    ``repeats`` timings."""
    import numpy as np
    import torch

    from bubblefree.cuda_backend.graphs import bucket
    from bubblefree.cuda_backend.kernel_config import Dispatch, KernelConfig
    from bubblefree.cuda_backend.kv_cache import PagedKVCache
    from bubblefree.cuda_backend.runner import ModelRunner, staging_size
    from bubblefree.cuda_backend.sampling import pack_sampling
    from bubblefree.cuda_backend.token_prefill import TokenPrefill

    cap = Capacity(num_pages=8192, page_size=16, max_rows=64, max_seqs=256, max_prefill_tokens=2048,
                   max_context=4096)
    cache = PagedKVCache(layers=1, kv_heads=1, head_dim=2, num_pages=cap.num_pages, page_size=cap.page_size,
                         dtype=torch.float32, device=torch.device("cpu"))
    runner = ModelRunner(None, cache, cap, torch.device("cpu"), KernelConfig())
    plan = StepPlan(0, StepKind.DECODE, tuple(StepRow(i, i, (), 100 + i, tuple(range(12 * i, 12 * i + 12)),
                                                      GREEDY, None) for i in range(rows)))
    staging, sample = np.zeros(staging_size(cap), dtype=np.int64), np.zeros(8 * cap.max_rows, dtype=np.int64)
    masks, number = (None,) * rows, 200

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6

    tp = TokenPrefill(None, cache, cap.max_prefill_tokens, cap.max_rows, runner.max_pages,
                      torch.device("cpu"), Dispatch())
    prefill = StepPlan(1, StepKind.PREFILL, tuple(
        StepRow(i, i, tuple(range(100 + i, 132 + i)), 0, (3 * i, 3 * i + 1, 3 * i + 2), GREEDY, None)
        for i in range(rows)))
    t, b = bucket(32 * rows, tp.tokens), bucket(rows, tp.rows)
    return (best(lambda: runner.pack_decode(plan, staging, rows, 16)),
            best(lambda: pack_sampling(sample, plan.rows, masks, rows, runner.scratch_row)),
            best(lambda: tp.pack(prefill, staging, t, b)))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/bookkeeping.md")
    args = ap.parse_args(argv)
    lines = ["| streams | mode | µs per decode step | µs per sequence-step |",
             "|---:|---|---:|---:|"]
    for streams in STREAMS:
        for pipelined, mode in MODES:
            runs = [measure(streams, args.tokens, pipelined) for _ in range(args.repeats)]
            step = statistics.median(r[0] for r in runs)
            per_seq = statistics.median(r[1] for r in runs)
            lines.append(f"| {streams} | {mode} | {step:.1f} | {per_seq:.2f} |")
            print(lines[-1], flush=True)
    lines += ["", "| rows | pack_decode µs a step | pack_sampling µs a step | token prefill pack µs a step |",
              "|---:|---:|---:|---:|"]
    for rows in STREAMS:
        decode, sampling, prefill = packing(rows, max(args.repeats, 3))
        lines.append(f"| {rows} | {decode:.1f} | {sampling:.1f} | {prefill:.1f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    header = (f"## Core bookkeeping, {datetime.date.today().isoformat()}\n\n"
              f"CPU: {platform.processor() or platform.machine()}, Python {platform.python_version()}. "
              f"Command: `python -m bubblefree.bench.bookkeeping --tokens {args.tokens} --repeats {args.repeats}`. "
              "A zero-cost GPU; time inside backend calls subtracted; median of the repeats. "
              "Then the CUDA backend's host packing of a decode step (12 pages a row, greedy) and of a "
              "prefill of 32-token prompts as token rows, the best of the repeats (at least 3) of 200 calls. "
              "Absolute µs are of this CPU: compare rows, not machines.\n\n")
    print("\n" + table)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        intro = "# CPU cost of the core's bookkeeping\n\nThe work pipelining hides under the next forward.\n\n"
        old = path.read_text() if path.exists() else intro
        path.write_text(old.rstrip() + "\n\n" + header + table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
