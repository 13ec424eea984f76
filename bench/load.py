"""Many clients at once against running servers, some leaving early: do
they keep up, and do they get everything back?

    python -m bubblefree.bench.load [--url http://127.0.0.1:2020 ...] [--clients 16]
        [--workload query|point] [--images 0] [--requests 200] [--duration 60]
        [--stream 0.5] [--leave 0.2] [--out docs/benchmarks.md]

*clients* loopback clients (asyncio tasks sharing one httpx client) send
Moondream requests (``/v1/query``, or ``/v1/point`` for *workload* point)
one after another until *requests* have been sent or *duration* seconds
have passed; with *images*, each request carries the next of that many
random 378-px images (``bench/load_images.py``), made before the timing. A
share (*stream*) of queries streams; a share (*leave*) disconnects on
purpose: a stream after its first piece, a waiting request *leave-after*
seconds after its body went out, before its answer. Reported: requests per
second (answered in full within *duration*, over it; ``window``), time to
first token (p50, p99; streams only, as a waiting request has no first
token to see) and latency (requests that ran to the end), errors by kind,
and the load's own CPU time per second (near 1, the client and not the
server would be what is measured).

Then ``/v1/stats`` is polled until the server has settled (bounded by
*settle*): every request sent was counted once (answered, or 499 for a
client that left), none is live or queued, and every KV page and row slot
is free again (``bench/load_checks.py``). A check that fails is reported and
the exit status is 1. Given several ``--url``, the clients are spread across
the servers (``bench/load_spread.py``) and each server is checked on its
own. The table is printed and, with ``--out``, written into
docs/benchmarks.md; ``bench/load_grid.py`` runs a grid of these.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import itertools
import random
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Iterator, Sequence

import attrs
import httpx

from bubblefree.bench.doc_block import write_block
from bubblefree.bench.load_checks import Stats, checks, settle
from bubblefree.bench.load_request import OBJECT, QUESTION, Outcome, Plan, body, one

__all__ = ["OBJECT", "QUESTION", "Load", "Outcome", "Plan", "Stats", "body", "checks", "main", "measure",
           "one", "run", "sent_and_left", "settle", "summary", "window"]

BEGIN, END = "<!-- load:begin -->", "<!-- load:end -->"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
WORKLOADS = ("query", "point")  # query may stream; point answers whole


@attrs.frozen
class Load:
    url: str
    workload: str = "query"
    clients: int = 16
    requests: int = 200
    duration_s: float = 60.0
    stream: float = 0.5
    leave: float = 0.2
    leave_after_s: float = 0.02
    max_tokens: int = 32
    request_timeout_s: float = 60.0
    settle_s: float = 15.0  # above load_checks.ROUND_S: a round may outlast Ray's cached queue lengths
    ready_s: float = 120.0  # bound on waiting for every replica to answer before the load
    seed: int = 0
    start_at: float | None = None  # time.time() at which the clients start; None: at once
    replicas: int = 1  # replicas behind the address (Ray Serve's): its checks read each one
    checked: bool = True  # False: another process checks the address (it is shared; load_spread)


@attrs.frozen
class Measured:
    """One server's cell as measured, before it is summed up (it travels
    back from a load process, so it holds plain values)."""
    outcomes: list[Outcome]
    wall_s: float
    model: str
    checks: dict[str, bool]
    cpu: float  # the load's CPU seconds per wall second
    images_reused: int  # requests that sent an image an earlier one sent
    in_window: int  # requests answered in full within the window (``window``)
    window_s: float


def plans(load: Load) -> Iterator[Plan]:
    rng = random.Random(load.seed)
    streams = load.workload == "query"
    for _ in range(load.requests):
        stream = rng.random() < load.stream
        yield Plan(stream=stream and streams, leave=rng.random() < load.leave)


async def client(http: httpx.AsyncClient, load: Load, todo: Iterator[Plan], deadline: float,
                 outcomes: list[Outcome], images: Iterator[str | None]) -> None:
    while time.monotonic() < deadline:
        plan = next(todo, None)  # one iterator shared by all clients: the count bounds the loop
        if plan is None:
            return
        outcomes.append(await one(http, load, plan, next(images)))


def check(load: Load) -> None:
    host = urllib.parse.urlsplit(load.url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {host!r}")
    if load.replicas < 1:
        raise SystemExit(f"replicas must be at least 1, got {load.replicas}")
    if load.workload not in WORKLOADS:
        raise SystemExit(f"workload must be one of {', '.join(WORKLOADS)}, got {load.workload!r}")


async def measure(load: Load, images: Sequence[str] = ()) -> Measured:
    """One server under ``load``; ``images``, if any, sent one a request in turn."""
    check(load)
    limits = httpx.Limits(max_connections=load.clients + 2, max_keepalive_connections=load.clients + 2)
    async with httpx.AsyncClient(limits=limits, timeout=load.request_timeout_s, trust_env=False) as http:
        model = "?"
        stats = Stats(http, load.url, load.replicas)
        if load.checked:  # else no call beside the load's: the checker counts what the processes send
            model = (await http.get(f"{load.url}/health")).json().get("model", "?")
            await stats.read_all(load.ready_s)
        if load.start_at is not None:  # several load processes start together
            await asyncio.sleep(max(0.0, load.start_at - time.time()))
        outcomes: list[Outcome] = []
        todo, start, cpu = plans(load), time.monotonic(), time.process_time()
        pictures = itertools.cycle(images) if images else itertools.repeat(None)
        await asyncio.gather(*(client(http, load, todo, start + load.duration_s, outcomes, pictures)
                               for _ in range(load.clients)))
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
        sent, left_waiting = sent_and_left(outcomes)
        result = await settle(stats, sent, load.settle_s, left_waiting=left_waiting) if load.checked else {}
    reused = max(0, len(outcomes) - len(images)) if images else 0
    return Measured(outcomes, wall, model, result, cpu / wall if wall else 0.0, reused,
                    *window(load, outcomes, start, wall))


def sent_and_left(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    """Requests whose body went out, and those of them whose client left
    before any answer came (``checks``' two counts)."""
    return (sum(o.sent for o in outcomes),
            sum(o.sent and o.left and o.status is None and o.ttft_s is None for o in outcomes))


def window(load: Load, outcomes: list[Outcome], start: float, wall: float) -> tuple[int, float]:
    """The requests answered in full within the cell's window, and the
    window: its duration when time ended the cell, or the wall time when the
    request count ran out first. Requests still running at the end of the
    duration count in latency, not in req/s: their tail grows with the
    latency, and dividing by the wall time would understate a slow server's
    req/s more than a fast one's."""
    if len(outcomes) >= load.requests:
        return sum(o.latency_s is not None for o in outcomes), wall
    end = start + load.duration_s
    return sum(o.ended is not None and o.ended <= end for o in outcomes), load.duration_s


async def run(load: Load, images: Sequence[str] = ()) -> dict[str, Any]:
    m = await measure(load, images)
    return summary(load, m.outcomes, m.wall_s, m.model, (m.in_window, m.window_s)) | {
        "checks": m.checks, "load_cpu": [m.cpu], "images_reused": m.images_reused}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(load: Load, outcomes: list[Outcome], wall: float, model: str,
            rate: tuple[int, float]) -> dict[str, Any]:
    """``rate``: requests answered within the window, and the window (``window``)."""
    done = [o for o in outcomes if o.latency_s is not None]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    latency = [o.latency_s for o in done]
    return dict(model=model, workload=load.workload, clients=load.clients, requests=len(outcomes), wall_s=wall,
                completed=len(done), req_s=rate[0] / rate[1] if rate[1] else 0.0, window_s=rate[1],
                left_stream=sum(o.left and o.plan.stream for o in outcomes),
                left_wait=sum(o.left and not o.plan.stream for o in outcomes),
                errors=dict(collections.Counter(o.error for o in outcomes if o.error)),
                ttft_ms=[_ms(percentile(ttft, q)) for q in (0.5, 0.99)],
                latency_ms=[_ms(percentile(latency, q)) for q in (0.5, 0.99)])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def table(r: dict[str, Any]) -> str:
    def pair(values: list[float | None]) -> str:
        return " / ".join("–" if v is None else f"{v:,.1f}" for v in values)
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
    lines = ["| clients | requests | completed | left early (stream / wait) | errors | req/s | "
             "TTFT p50 / p99 ms | latency p50 / p99 ms |",
             "|---:|---:|---:|---|---|---:|---|---|",
             f"| {r['clients']} | {r['requests']} | {r['completed']} | {r['left_stream']} / {r['left_wait']} | "
             f"{errors} | {r['req_s']:,.1f} | {pair(r['ttft_ms'])} | {pair(r['latency_ms'])} |",
             "", "| check after the load | holds |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in r["checks"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bubblefree.bench.load", description=__doc__.splitlines()[0])
    d = Load(url="http://127.0.0.1:2020")
    ap.add_argument("--url", action="append", default=None,
                    help=f"a server (loopback only; default {d.url}); again for each further server")
    ap.add_argument("--workload", choices=WORKLOADS, default=d.workload)
    ap.add_argument("--images", type=int, default=0,
                    help="send each request one of this many random images, in turn (0: no image)")
    ap.add_argument("--image-side", type=int, default=378)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--requests", type=int, default=d.requests, help="at most this many, in all")
    ap.add_argument("--duration", type=float, default=d.duration_s, help="no request starts after this (s)")
    ap.add_argument("--stream", type=float, default=d.stream, help="share of queries that stream")
    ap.add_argument("--leave", type=float, default=d.leave, help="share of requests whose client leaves early")
    ap.add_argument("--leave-after", type=float, default=d.leave_after_s,
                    help="seconds a waiting client that leaves stays after sending")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--timeout", type=float, default=d.request_timeout_s, help="one request's bound (s)")
    ap.add_argument("--settle", type=float, default=d.settle_s, help="bound on waiting for the server to settle (s)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--ready", type=float, default=d.ready_s,
                    help="bound on waiting for every replica to answer before the load (s)")
    ap.add_argument("--replicas", type=int, default=d.replicas,
                    help="replicas behind each --url (serve --replicas N): the checks read every one")
    ap.add_argument("--out", default="", help="write the table into this file (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    urls = [u.rstrip("/") for u in args.url or [d.url]]
    load = Load(url=urls[0], workload=args.workload, clients=args.clients, requests=args.requests,
                duration_s=args.duration, stream=args.stream, leave=args.leave,
                leave_after_s=args.leave_after, max_tokens=args.max_tokens,
                request_timeout_s=args.timeout, settle_s=args.settle, ready_s=args.ready, seed=args.seed,
                replicas=args.replicas)
    for url in urls:
        check(attrs.evolve(load, url=url))
    if len(urls) == 1:
        from bubblefree.bench.load_images import pool
        result = asyncio.run(run(load, pool(args.images, args.image_side, args.seed)))
    else:
        from bubblefree.bench.load_spread import Spread
        with Spread(urls, images=args.images, side=args.image_side, seed=args.seed) as spread:
            result = spread.run(load)
    command = "python -m bubblefree.bench.load " + " ".join(sys.argv[1:] if argv is None else argv)
    where = f"{len(urls)} servers, client i asking server i mod {len(urls)}. " if len(urls) > 1 else ""
    result["text"] = (f"## Load through HTTP, {datetime.date.today()}\n\n"
                      f"Model: {result['model']}. Command: `{command.strip()}`. {where}{load.clients} clients, "
                      f"{result['requests']} {load.workload} requests in {result['wall_s']:.1f} s; streams "
                      f"{load.stream if load.workload == 'query' else 0:.0%}, clients leaving early "
                      f"{load.leave:.0%}. TTFT from streams only; latency of requests that ran to the end.\n\n"
                      + table(result) + "\n")
    print(result["text"])
    if args.out:
        write_block(Path(args.out), BEGIN, END, result["text"])
    return result


if __name__ == "__main__":
    sys.exit(0 if all(main()["checks"].values()) else 1)
