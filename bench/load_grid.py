"""The load grid: each workload at each client count, against one server or
several, each cell bounded in time; one JSON record of the run.

    python -m bubblefree.bench.load_grid --url http://127.0.0.1:2020 [--url ...]
        [--workloads query,point] [--clients 1,8,32,128] [--duration 6] [--warmup 3]
        [--images 2048] [--label "one replica"] [--record grid.json]

Every request in a cell asks about a different random 378-px image
(``load_images``), sent as a data URI as moondream's client sends it; queries are capped at
``--max-tokens`` (10) and a share of them stream (``--stream``); point asks
for one object. The clients are spread across the servers one load process
per server (``load_spread``), also for one server, so one server and two
are driven the same way. Before each workload's cells, a warm-up cell at
the largest client count runs untimed: a server's first requests of a shape
pay for its first image crops and allocations. Each cell then runs for
``--duration`` seconds (no request starts after it) and is checked after it
settles: every request counted once, none live or queued, every KV page and
row slot free (``load_checks``). ``bench/load_compare.py`` sets two records
side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import attrs

from bubblefree.bench.load import WORKLOADS, Load
from bubblefree.bench.load_spread import Spread


def cells(spread: Spread, base: Load, workloads: list[str], clients: list[int], warmup_s: float,
          say: Callable[[str], None] = print, after: Callable[[list[dict], list[dict]], None] = lambda r, w: None
          ) -> tuple[list[dict], list[dict]]:
    """Every cell, in order; ``after(rows, warmups)`` once each is measured
    (the record is written then, so a run cut short keeps what it measured)."""
    rows: list[dict] = []
    warm: list[dict] = []
    for workload in workloads:
        load = attrs.evolve(base, workload=workload)
        if warmup_s > 0:
            w = spread.run(attrs.evolve(load, clients=max(clients), duration_s=warmup_s))
            warm.append(_brief(w))
            say(f"warm-up {workload} x{max(clients)}: {w['completed']} answered, errors {w['errors'] or 0}")
        for n in clients:
            r = spread.run(attrs.evolve(load, clients=n))
            rows.append(r)
            say(line(r))
            after(rows, warm)
    return rows, warm


def _brief(r: dict) -> dict:
    return {k: r[k] for k in ("workload", "clients", "requests", "completed", "errors", "req_s")}


def line(r: dict) -> str:
    def pair(v: list) -> str:
        return " / ".join("-" if x is None else f"{x:.1f}" for x in v)
    held = all(r["checks"].values())
    return (f"{r['workload']:>5} x{r['clients']:<3} {r['req_s']:8.1f} req/s  latency p50/p99 "
            f"{pair(r['latency_ms'])} ms  TTFT {pair(r['ttft_ms'])} ms  {r['completed']}/{r['requests']} done  "
            f"errors {r['errors'] or 0}  per server {[s['requests'] for s in r['servers']]}  "
            f"load CPU {r['load_cpu']}  checks {'hold' if held else 'FAIL'}")


def shown(argv: list[str]) -> str:
    """The command as the docs show it: what shaped the load, not where its
    record went or what the run was called."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--record", "--env", "--label"):
            skip = True
        elif not arg.startswith(("--record=", "--env=", "--label=")):
            kept.append(arg)
    return "python -m bubblefree.bench.load_grid " + shlex.join(kept)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bubblefree.bench.load_grid",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append", required=True, help="a server (loopback); again for each more")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--clients", default="1,8,32,128")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds a cell sends requests")
    ap.add_argument("--warmup", type=float, default=3.0, help="untimed seconds before each workload")
    ap.add_argument("--requests", type=int, default=1_000_000, help="at most this many a cell")
    ap.add_argument("--images", type=int, default=2048, help="different images each load process sends, in turn")
    ap.add_argument("--image-side", type=int, default=378)
    ap.add_argument("--max-tokens", type=int, default=10, help="a query's answer cap")
    ap.add_argument("--stream", type=float, default=0.5, help="share of queries that stream")
    ap.add_argument("--leave", type=float, default=0.05, help="share of requests whose client leaves early")
    ap.add_argument("--timeout", type=float, default=60.0, help="one request's bound (s)")
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=1,
                    help="replicas behind each --url (serve --replicas N): the checks read every one")
    ap.add_argument("--label", default="", help="what was served, for the record (\"one replica\")")
    ap.add_argument("--env", default="", help="the machine, for the record")
    ap.add_argument("--record", default="", help="write the run as JSON here")
    args = ap.parse_args(argv)
    workloads = args.workloads.split(",")
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    clients = [int(c) for c in args.clients.split(",")]
    base = Load(url=args.url[0], requests=args.requests, duration_s=args.duration, stream=args.stream,
                leave=args.leave, max_tokens=args.max_tokens, request_timeout_s=args.timeout,
                settle_s=args.settle, seed=args.seed, replicas=args.replicas)
    print(f"{args.label or 'load grid'}: {len(args.url)} server(s) {args.url}, one load process each; "
          f"client i asks server i mod {len(args.url)}", flush=True)
    record = dict(label=args.label, env=args.env, date=str(datetime.date.today()), urls=args.url,
                  command=shown(sys.argv[1:] if argv is None else argv),
                  settings=dict(duration_s=args.duration, warmup_s=args.warmup, images=args.images,
                                image_side=args.image_side, max_tokens=args.max_tokens, stream=args.stream,
                                leave=args.leave),
                  replicas=args.replicas, model="?", cells=[], warmup=[])

    def save(rows: list[dict], warm: list[dict]) -> None:
        record.update(model=rows[0]["model"], cells=rows, warmup=warm)
        if args.record:
            Path(args.record).write_text(json.dumps(record, indent=1) + "\n")

    with Spread(args.url, images=args.images, side=args.image_side, seed=args.seed) as spread:
        cells(spread, base, workloads, clients, args.warmup, say=lambda s: print(s, flush=True), after=save)
    return record


if __name__ == "__main__":
    record = main()
    sys.exit(0 if all(all(r["checks"].values()) and not r["errors"] for r in record["cells"]) else 1)
