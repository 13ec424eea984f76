"""Auto's per-tick choice on the simulated GPU, beside pipelined and blocking.

Closed loops of callers (each answers its request's end with the next, sent
between ticks as ``bench.speed`` does, at once or a while later, as a
client across a network would) on the fake backend's virtual clock, across
host and device costs, stream counts and skills that end rarely or often.
Each cell runs the three modes on the same requests; the outputs must agree
(I8). The table gives each mode's simulated time and auto's speed over the
better of the other two (issue 14's target: >= 0.98).

Simulated time units (a decode forward of 1.0 when the device is the
limit): these compare the modes' orders, not any GPU. ``--choose-cost``
charges the rule's own host work, per row of the step it weighs, on the
host clock (0 by default: the choice free); ``--every-tick`` weighs the
rule at every tick even where its choices have bought less than that
(``core.ahead_measures.Worth`` off).

    python -m bubblefree.bench.auto_sim [--seeds 3] [--per-stream 12] [--out docs/auto-sim.md]
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import random
import sys
from pathlib import Path

import attrs

from bubblefree.core import Engine, Request
from bubblefree.core.ahead_measures import Worth
from bubblefree.fake_backend import FakeBackend, FakeModel, Timing

MODES = ((True, "pipelined"), (False, "blocking"), ("auto", "auto"))
STREAMS = (1, 8, 32)
# A prefill step costs PREFILL + PREFILL_PER_ROW x its rows decode forwards:
# by default a fixed three (a text prefill of short prompts); moondream2's
# image prefill of one image is about ten, and grows with its rows. Its
# launch call costs PREFILL_LAUNCH times a decode step's host time: 1 by
# default; about 9 for moondream2's image prefill (1.3-1.5 ms against
# 0.15-0.2 on the H200, docs/runs/vlm-timeline-2026-12-01.txt).
PREFILL, PREFILL_PER_ROW, PREFILL_LAUNCH = 3.0, 0.0, 1.0
# (name, decode forward, launch host, finalize host, commit host per row)
REGIMES = (("device-bound", 1.0, 0.1, 0.05, 0.002),
           ("balanced", 0.4, 0.15, 0.1, 0.002),
           ("host-bound", 0.2, 0.15, 0.1, 0.01))
# (name, the time from an end reaching its caller to the caller's next request):
# an in-process loop, and a client a network away (a decode forward's time)
CALLERS = (("next at once", 0.0), ("next after 1.0", 1.0))
# (name, chance a request ends at each token after its first, or None: ends at its third token,
# and whether it also says it may end at its first, as an object list does where it may be empty)
SKILLS = (("text", 0.02, False), ("ends 30%", 0.3, False), ("ends 90%", 0.9, False),
          ("point (3 tokens)", None, False), ("detect (3 tokens, may end at 1)", None, True))


@attrs.define
class Ending:
    """A skill that ends at each token with chance ``p`` (drawn from its own
    seeded stream, so every mode sees the same ends), or, with ``p`` None,
    at its third token, saying so (``may_end``) only there, as point does,
    or (``early``) there and at its first, as moondream2's object lists
    do: their first token may be the end of an empty list."""

    rng: random.Random
    p: float | None
    early: bool = False
    at: int = 0

    def mask_id(self) -> None:
        return None

    def advance(self, token: int, value: float | None) -> bool:
        self.at += 1
        return self.at == 3 if self.p is None else self.rng.random() < self.p

    def may_end(self) -> bool:
        return self.p is not None or self.at == 2 or (self.early and self.at == 0)


class EveryTick(Worth):
    """Weighs the rule at every tick, whatever its choices have bought."""

    def weigh(self) -> bool:
        return True


def requests(p: float | None, n: int, seed: int, early: bool = False) -> list[Request]:
    rng = random.Random(seed)
    return [Request(prompt=(1, 2, 3), max_tokens=40, skill="sim",
                    decode_state=lambda s=rng.random(): Ending(random.Random(s), p, early)) for _ in range(n)]


def run(pipelined: bool | str, regime: tuple, streams: int, reqs: list[Request], think: float = 0.0,
        prefill: tuple[float, float, float] = (PREFILL, PREFILL_PER_ROW, PREFILL_LAUNCH),
        inbox: bool = False, choose_cost: float = 0.0, every_tick: bool = False) -> tuple[float, list]:
    """Simulated time to answer ``reqs`` with ``streams`` callers, each
    sending its next request ``think`` after its last one's end reached it,
    and the outputs. ``inbox``: a request whose time comes during a tick
    waits in an inbox the core can count (``Engine.arrivals``), as the
    serving loop's callers on other threads do; it is still submitted
    between ticks. ``choose_cost``: the rule's host work per row of the
    step it weighs, spent inside the engine's timing of its choice (the
    inbox count it reads there is the one call out); ``every_tick``: no
    ``Worth``, the rule weighed at every tick."""
    _, forward, launch, finalize, per_row = regime
    # The commit's host cost per row is charged at release, after the
    # scheduler's commit, where the engine's clock sees it, as it sees the
    # real commit's bookkeeping (the fake's own commit costs fall inside
    # ``wait``, where they would pass for device time).
    fixed, per_row_prefill, prefill_launch = prefill
    timing = Timing(forward=lambda w: forward * (1.0 if w.kind.value == "decode" else
                                                 fixed + per_row_prefill * w.rows),
                    sampling=0.0, copy=0.0, finalize_cost=finalize,
                    launch_cost=lambda w: launch * (1.0 if w.kind.value == "decode" else prefill_launch),
                    commit_cost_per_row=0.0, release_cost=lambda w: per_row * w.rows)
    backend = FakeBackend(model=FakeModel(), timing=timing, max_rows=streams, max_seqs=4 * streams,
                          num_pages=8192, page_size=16, max_prefill_tokens=64 * streams)
    engine = Engine(backend, pipelined=pipelined, clock=lambda: backend.clock.host)
    if every_tick:
        engine.worth = EveryTick()
    todo, handles, ended, due = list(reversed(reqs)), [], [], []

    def arrivals() -> int:
        if choose_cost and engine.scheduler.inflight:
            backend.clock.spend(choose_cost * len(engine.scheduler.inflight[-1].seq_ids))
        return min(len(todo), sum(1 for t in due if t <= backend.clock.host)) if inbox else 0
    engine.arrivals = arrivals

    def submit() -> None:
        handles.append(engine.submit(todo.pop()))
        handles[-1].listeners.append(lambda h, token: token is None and ended.append(h))

    for _ in range(min(streams, len(todo))):
        submit()
    while True:
        while due and due[0] <= backend.clock.host and todo:  # between ticks, like a caller's loop
            heapq.heappop(due)
            submit()
        if engine.has_work():
            engine.tick()
        elif due and todo:
            backend.clock.wait_until(due[0])  # idle until a caller's next request
        else:
            break
        for _ in ended:
            heapq.heappush(due, backend.clock.host + think)
        ended.clear()
    return backend.clock.host, [h.result.tokens for h in handles]


def cell(regime: tuple, streams: int, p: float | None, think: float, seeds: int, per_stream: int,
         prefill: tuple[float, float, float] = (PREFILL, PREFILL_PER_ROW, PREFILL_LAUNCH),
         early: bool = False, inbox: bool = False, choose_cost: float = 0.0,
         every_tick: bool = False) -> dict[str, float]:
    times = dict.fromkeys((name for _, name in MODES), 0.0)
    for seed in range(seeds):
        reqs = requests(p, max(per_stream * streams, 24), seed, early)
        outputs = {}
        for pipelined, name in MODES:
            t, outputs[name] = run(pipelined, regime, streams, reqs, think, prefill, inbox, choose_cost,
                                   every_tick)
            times[name] += t
        if len({tuple(o) for o in outputs.values()}) != 1:
            raise AssertionError(f"I8: the modes' outputs differ ({regime[0]}, {streams} streams, p={p})")
    return times


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--per-stream", type=int, default=12, help="requests per stream in each run")
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)))
    ap.add_argument("--prefill", type=float, default=PREFILL, help="a prefill step's fixed cost, in forwards")
    ap.add_argument("--prefill-per-row", type=float, default=PREFILL_PER_ROW,
                    help="and its cost per row, in forwards")
    ap.add_argument("--prefill-launch", type=float, default=PREFILL_LAUNCH,
                    help="a prefill's launch call, in decode launches' host time")
    ap.add_argument("--skills", default=None, help="a comma-separated subset of the skills, each by its "
                    "name or its name's first word (default: all)")
    ap.add_argument("--inbox", action="store_true",
                    help="a request due during a tick waits in an inbox the core counts, as the "
                         "serving loop's callers on other threads do")
    ap.add_argument("--choose-cost", type=float, default=0.0,
                    help="the rule's own host work per row of the step it weighs, in forwards")
    ap.add_argument("--every-tick", action="store_true",
                    help="weigh the rule at every tick, whatever its choices have bought")
    ap.add_argument("--out", default="docs/auto-sim.md", help="append the table here ('' for none)")
    args = ap.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    skills = SKILLS
    if args.skills:
        wanted = set(args.skills.split(","))
        skills = tuple(k for k in SKILLS if k[0] in wanted or k[0].split()[0] in wanted)
        unknown = wanted - {k[0] for k in skills} - {k[0].split()[0] for k in skills}
        if unknown:
            ap.error(f"--skills: unknown {sorted(unknown)}; the skills are {[k[0] for k in SKILLS]}")
    lines = ["| regime | skill | callers | streams | pipelined | blocking | auto | auto ÷ better |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    misses = 0
    for regime in REGIMES:
        for skill, p, early in skills:
            for caller, think in CALLERS:
                for n in streams:
                    t = cell(regime, n, p, think, args.seeds, args.per_stream,
                             (args.prefill, args.prefill_per_row, args.prefill_launch), early,
                             args.inbox, args.choose_cost, args.every_tick)
                    ratio = min(t["pipelined"], t["blocking"]) / t["auto"]
                    misses += ratio < 0.98
                    lines.append(f"| {regime[0]} | {skill} | {caller} | {n} | {t['pipelined']:.1f} | "
                                 f"{t['blocking']:.1f} | {t['auto']:.1f} | "
                                 f"{ratio:.3f}{'' if ratio >= 0.98 else ' (miss)'} |")
                    print(lines[-1], flush=True)
    cells = len(lines) - 2
    table = "\n".join(lines) + f"\n\nauto >= 0.98x the better mode in {cells - misses} of {cells} cells."
    print("\n" + table)
    if args.out:
        path = Path(args.out)
        old = path.read_text() if path.exists() else (
            "# Auto's choice on the simulated GPU\n\n`python -m bubblefree.bench.auto_sim`: simulated time "
            "to answer every request (lower is better), the sum over the seeds.\n")
        header = (f"## {datetime.date.today().isoformat()}, a prefill of {args.prefill:g} forwards "
                  f"and {args.prefill_per_row:g} a row, its launch {args.prefill_launch:g} decode launches"
                  + (", callers' requests counted in an inbox" if args.inbox else "")
                  + (f", the rule's host work {args.choose_cost:g} a row" if args.choose_cost else "")
                  + (", weighed at every tick" if args.every_tick else "")
                  + f"\n\nCommand: `python -m bubblefree.bench.auto_sim "
                  f"--seeds {args.seeds} --per-stream {args.per_stream} --streams {args.streams} "
                  f"--prefill {args.prefill:g} --prefill-per-row {args.prefill_per_row:g} "
                  f"--prefill-launch {args.prefill_launch:g}{' --inbox' if args.inbox else ''}"
                  f"{f' --choose-cost {args.choose_cost:g}' if args.choose_cost else ''}"
                  f"{' --every-tick' if args.every_tick else ''}`. "
                  f"Decode forward, launch, finalize and per-row commit host costs per regime: "
                  + "; ".join(f"{r[0]} {r[1]}, {r[2]}, {r[3]}, {r[4]}" for r in REGIMES)
                  + f"; a prefill costs {args.prefill:g} forwards and {args.prefill_per_row:g} a row; "
                  "the commit's host cost is paid after the "
                  "copy's arrival, where the engine's clock sees it. Callers send their next request "
                  + " or ".join(f"{think:g}" for _, think in CALLERS) + " after an end reaches them"
                  + (", into an inbox the core counts" if args.inbox else "") + ".\n\n")
        path.write_text(old.rstrip() + "\n\n" + header + table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
