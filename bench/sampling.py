"""A decode step's sampling alone, per kind of draw, beside transformers'.

The engine samples a step in one of three graphs (``sampling.Draw``):
greedy (the greedy kernel where Triton runs, else torch), drawn with no
cut (Gumbel-max over the scaled logits), drawn with a cut (a sort of
each row's vocabulary for top-k, top-p and min-p); where Triton runs, the
drawn ones also with their noise in Triton (``KernelConfig.draw_kernel``:
no cut, the greedy kernel drawing; a cut, one kernel's noise added to the
sort), and a cut in two kernels around the sort (``KernelConfig.cut_kernel``,
``cut_sample``); and the sort alone, and a top-k, to weigh the rest. Timed here on random
logits of a vocabulary's width, at several row counts, each replayed
from a CUDA graph as the backend replays it (eager on a CPU), beside
transformers' own sampling of the same rows in the same run: its
temperature and top-p warpers, a softmax and ``torch.multinomial``,
also from a graph.

    python -m bubblefree.bench.sampling [--vocab 151936] [--rows 1,8,32,64]
                                        [--repeats 200] [--out docs/benchmarks.md]

Prints a table of µs per step and writes it to ``--out`` (between its
own markers). An absolute time counts only from a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Callable

import attrs
import numpy as np
import torch

from bubblefree.bench.doc_block import write_block
from bubblefree.cuda_backend import gumbel
from bubblefree.cuda_backend.cut_sample import make_cut_sampler
from bubblefree.cuda_backend.greedy_sample import make_sampler, torch_greedy
from bubblefree.core.values import SamplingParams, StepRow
from bubblefree.cuda_backend.sampling import (PARTS, Draw, gumbel_noise, pack_sampling,
                                              sample_tokens, unpack_sampling, vocab_hash)

# (label, Draw, top_p, top_k, kernels): the engine's cases, temperature
# 0.7 in each drawn one; kernels "" (torch's), "noise" (``draw_kernel``'s:
# the one-kernel draw without a cut, the noise kernel with one) or "cut"
# (``cut_kernel``'s two kernels around the sort).
CASES = (("greedy", Draw.GREEDY, 1.0, 0, ""), ("drawn, no cut", Draw.PLAIN, 1.0, 0, ""),
         ("top_p 0.9", Draw.CUT, 0.9, 0, ""), ("top_k 50", Draw.CUT, 1.0, 50, ""),
         ("drawn, no cut, one kernel", Draw.PLAIN, 1.0, 0, "noise"),
         ("top_p 0.9, noise kernel", Draw.CUT, 0.9, 0, "noise"),
         ("top_p 0.9, cut kernels", Draw.CUT, 0.9, 0, "cut"),
         ("top_k 50, cut kernels", Draw.CUT, 1.0, 50, "cut"))
PEER = "transformers: temperature + top_p 0.9 warpers, multinomial"
TOPK = 1024  # ``pieces``' top-k: a candidate set a sort-free cut could start from


def pieces(v: int) -> tuple[tuple[str, Callable[[torch.Tensor], object]], ...]:
    """Parts of a cut step timed alone, to weigh what is left around them:
    torch's stable sort of each row (every sorted path's), and a top-k of
    at most ``TOPK`` (what a path that sorts only its candidates would run
    instead)."""
    k = min(TOPK, v)
    return (("the sort alone (stable, descending)",
             lambda x: torch.sort(x, dim=-1, descending=True, stable=True)),
            (f"torch.topk {k:,} alone (sorted)", lambda x: torch.topk(x, k, dim=-1)))
BEGIN, END = "<!-- sampling:begin -->", "<!-- sampling:end -->"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936, help="logits a row (Qwen2's vocabulary)")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=200, help="timed replays a cell")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="docs/benchmarks.md", help="write the table here ('' = no)")
    args = ap.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r]
    if args.vocab < 64 or args.repeats < 1 or not args.rows or min(args.rows) < 1:
        ap.error("--vocab at least 64, --repeats and every --rows at least 1")
    return args


def engine_step(case: tuple, logits: torch.Tensor, device: torch.device) -> Callable[[], object]:
    """One step's sampling as the backend's graph for ``case`` records it,
    from inputs ``pack_sampling`` lays out (row slots 0..b-1, no mask, seeds
    0..b-1, position 40)."""
    _, draw, top_p, top_k, kernel = case
    b, v = logits.shape
    sampling = SamplingParams(temperature=0.0 if draw is Draw.GREEDY else 0.7, top_p=top_p,
                              top_k=top_k)
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(), position=39, pages=(),
                         sampling=attrs.evolve(sampling, seed=i)) for i in range(b))
    packed = np.zeros(PARTS * b, dtype=np.int64)
    if pack_sampling(packed, rows, (None,) * b, b, scratch_row=b) is not draw:
        raise AssertionError(f"{case[0]}: the rows do not make a {draw} step")
    inputs = torch.from_numpy(packed).to(device)
    table = torch.ones(1, v, dtype=torch.bool, device=device)
    if draw is Draw.GREEDY or kernel == "cut" or (draw is Draw.PLAIN and kernel):
        sampled = torch.zeros(b, dtype=torch.long, device=device)
        last = torch.zeros(b, dtype=torch.long, device=device)
        if kernel == "cut":
            cut = make_cut_sampler(v, device)
            return lambda: cut(logits, table, inputs, b, sampled, last)
        if draw is Draw.PLAIN:
            drawn = make_sampler(b, v, device)
            return lambda: drawn(logits, table, inputs, b, sampled, last, drawn=True)
        greedy = make_sampler(b, v, device) or torch_greedy
        return lambda: greedy(logits, table, inputs, b, sampled, last)
    _, mask_ids, draws = unpack_sampling(inputs, b)
    salt = vocab_hash(v, device)
    noise = gumbel.noise if kernel else gumbel_noise
    return lambda: sample_tokens(logits, table, mask_ids, draws, salt, draw, noise)


def peer_step(logits: torch.Tensor) -> Callable[[], object]:
    """transformers' sampling of the same rows (``do_sample`` with
    temperature 0.7, top_p 0.9, no top_k): its warpers, softmax, multinomial."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    temperature, top_p = TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)

    def step():
        scores = top_p(ids, temperature(ids, logits.clone()))
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
    return step


def timed(step: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, str]:
    """µs per call (median of five rounds), replayed from a CUDA graph
    where it captures, else called as it is; and how it ran."""
    for _ in range(3):
        step()  # warm-up: kernels loaded, lazy state built
    run, how = step, "eager"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run, how = graph.replay, "graph"
        except RuntimeError as err:  # a step that cannot be captured runs eagerly, said so
            how = f"eager ({type(err).__name__})"
    rounds = []
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                run()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) * 1e3 / repeats)
        else:
            t = time.perf_counter()
            for _ in range(repeats):
                run()
            rounds.append((time.perf_counter() - t) * 1e6 / repeats)
    return statistics.median(rounds), how


def measure(args) -> list[dict]:
    device = torch.device(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for b in args.rows:
        logits = (torch.randn(b, args.vocab, generator=gen) * 3).to(device)  # [b, V] float32
        for case in CASES:
            if case[4] and not gumbel.available(device):
                continue  # Triton's kernels: CUDA only
            us, how = timed(engine_step(case, logits, device), device, args.repeats)
            rows.append(dict(rows=b, case=case[0], us=us, how=how))
            print(f"{b} rows, {case[0]}: {us:,.1f} µs ({how})", flush=True)
        for label, piece in pieces(args.vocab):
            us, how = timed(lambda piece=piece: piece(logits), device, args.repeats)
            rows.append(dict(rows=b, case=label, us=us, how=how))
            print(f"{b} rows, {label}: {us:,.1f} µs ({how})", flush=True)
        try:
            us, how = timed(peer_step(logits), device, args.repeats)
            rows.append(dict(rows=b, case=PEER, us=us, how=how))
        except Exception as err:  # noqa: BLE001 - a peer's failure is a table row
            rows.append(dict(rows=b, case=PEER, us=None, how=f"error: {err!r}"[:120]))
        print(f"{b} rows, {PEER}: {_us(rows[-1]['us'])} µs ({rows[-1]['how']})", flush=True)
    return rows


def table(rows: list[dict], args) -> str:
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    head = [f"## Sampling a step, {datetime.date.today()} ({device}, {args.vocab:,} logits a row)", "",
            f"`python -m bubblefree.bench.sampling --vocab {args.vocab} --rows "
            f"{','.join(map(str, args.rows))}`: µs per step, the median of five rounds of "
            f"{args.repeats} replays; temperature 0.7 wherever a token is drawn.", "",
            "| rows | sampling | µs a step | how it ran |", "|---:|---|---:|---|"]
    body = [f"| {r['rows']} | {r['case']} | {_us(r['us'])} | {r['how']} |" for r in rows]
    return "\n".join(head + body)


def _us(us: float | None) -> str:
    return "" if us is None else f"{us:,.1f}"


def main(argv=None) -> str:
    args = parse(argv)
    text = table(measure(args), args)
    print(text)
    if args.out:
        write_block(Path(args.out), BEGIN, END, text)
    return text


if __name__ == "__main__":
    main()
