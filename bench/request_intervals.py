"""Where one stream's text request spends its device time, interval by interval.

``bench.speed``'s text requests (32-token prompts, 110 tokens, greedy,
pipelined) at one and two streams on its backend with the timing hook:
each compute-stream interval in order (the prefill's forward or a decode
step's, then its sampling) and the gaps between them. What a step costs
beyond its captured forward (``bench.step_increments`` times the forward
itself): the sampling, the gaps, and the prefill's share. Where a step
samples ahead (``KernelConfig.sample_ahead``), its tokens are sampled
inside the forward's interval and its finalize's interval holds only the
copy's event.

    python -m bubblefree.bench.request_intervals [--model phi|llama1b|qwen05b] [--sample-ahead ROWS]
        [--trace]

With ``--trace`` one more run at one stream is profiled (without the
timing hook) and ``bench.step_gaps`` prints what the device ran between
two decode forwards.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from bubblefree.bench import speed
from bubblefree.bench.speed_cells import (FULL_TOKENS, TimedBackend, bin_masks, make_requests,
                                          run_closed_loop)
from bubblefree.bench.speed_setup import SHAPES, build_model
from bubblefree.bench.step_gaps import format_report, profiled
from bubblefree.core import Engine

REQUESTS = 4  # a stream's requests per run


def summary(spans: list[float], gaps: list[float], steps: int, prefills: int) -> dict:
    """ms per step from a run's compute-stream intervals (``spans``: each
    forward followed by its sampling, in order; a request's first forward
    is its prefill, the ``prefills`` longest) and the ``gaps`` between
    them: the decode forward's median, the sampling's, the gaps' share,
    and the prefills' share (their excess over a decode forward)."""
    forwards = sorted(spans[0::2], reverse=True)
    prefill, decodes = forwards[:prefills], forwards[prefills:]  # a prefill is the longest forward
    decode = statistics.median(decodes)
    return dict(decode_ms=decode, sampling_ms=statistics.median(spans[1::2]),
                gaps_ms=sum(gaps) / steps, prefill_ms=prefill,
                prefill_share_ms=sum(p - decode for p in prefill) / steps)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bubblefree.bench.request_intervals",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(SHAPES), default="llama1b")
    ap.add_argument("--sample-ahead", default=None, metavar="ROWS",
                    help="as bench.speed's (KernelConfig.sample_ahead; default: the config's)")
    ap.add_argument("--trace", action="store_true",
                    help="profile one more run at one stream: what runs between two forwards")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("the intervals are CUDA events: this needs a GPU")
    ahead = [] if args.sample_ahead is None else ["--sample-ahead", args.sample_ahead]
    options = speed.parse(["--model", args.model, "--streams", "1", *ahead])
    model, label = build_model(False, shape=args.model)
    device = next(model.parameters()).device
    backend = TimedBackend(model, page_size=16, num_pages=2 * 8 * math.ceil(speed.CONTEXT / 16) + 16,
                           max_rows=8, max_seqs=256, max_prefill_tokens=2048, max_context=speed.CONTEXT,
                           use_graphs=True, **speed.decode_options(options, device, model.config))
    print(f"{label}; decode step: {backend.decode_path}; prefill: {backend.prefill_path}", flush=True)
    mask_ids = tuple(Engine(backend).register_mask(m) for m in bin_masks(backend.vocab_size))
    out = []
    print("| streams | wall ms a step | decode forward (median) | sampling | gaps a step | "
          "prefills | prefills' share a step |\n|---:|---:|---:|---:|---:|---|---:|")
    for streams in (1, 2):
        reqs = make_requests("text", REQUESTS * streams, FULL_TOKENS, mask_ids, backend.vocab_size,
                             seed=streams)
        for _ in range(3):  # the last run's intervals are kept
            r = run_closed_loop(backend, reqs, streams, True, record=True)
        torch.cuda.synchronize(device)
        pairs = [(a, b) for a, b in backend.intervals if b is not None]
        spans = [a.elapsed_time(b) for a, b in pairs]
        gaps = [max(0.0, pairs[i - 1][1].elapsed_time(pairs[i][0])) for i in range(1, len(pairs))]
        s = dict(streams=streams, wall_ms=r["ms_step"], **summary(spans, gaps, r["steps"], len(reqs)))
        out.append(s)
        print(f"| {streams} | {s['wall_ms']:.4f} | {s['decode_ms']:.4f} | {s['sampling_ms']:.4f} | "
              f"{s['gaps_ms']:.4f} | {', '.join(f'{p:.3f}' for p in s['prefill_ms'])} | "
              f"{s['prefill_share_ms']:.4f} |", flush=True)
    if args.trace:
        reqs = make_requests("text", REQUESTS, FULL_TOKENS, mask_ids, backend.vocab_size, seed=1)
        print(format_report(profiled(lambda: run_closed_loop(backend, reqs, 1, True, record=False))),
              flush=True)
    return out


if __name__ == "__main__":
    main()
