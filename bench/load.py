"""Many clients at once against a running server, some leaving early: does
it keep up, and does it get everything back?

    python -m bubblefree.bench.load [--url http://127.0.0.1:2020] [--clients 16]
        [--requests 200] [--duration 60] [--stream 0.5] [--leave 0.2] [--out docs/benchmarks.md]

*clients* loopback clients (asyncio tasks sharing one httpx client) send
Moondream ``/v1/query`` requests one after another until *requests* have
been sent or *duration* seconds have passed. A share (*stream*) streams; a
share (*leave*) disconnects on purpose: a stream after its first piece, a
waiting request *leave-after* seconds after its body went out, before its
answer. Reported: completed requests per second, time to first token (p50,
p99; streams only, as a waiting request has no first token to see) and
latency (requests that ran to the end), errors by kind.

Then ``/v1/stats`` is polled until the server has settled (bounded by
*settle*): every request sent was counted once (answered, or 499 for a
client that left), none is live or queued, and every KV page and row slot
is free again. A check that fails is reported and the exit status is 1.
The table is printed and, with ``--out``, written into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import random
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Iterator

import attrs
import httpx

from bubblefree.bench.doc_block import write_block

BEGIN, END = "<!-- load:begin -->", "<!-- load:end -->"
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
QUESTION = "What is the cat on?"


@attrs.frozen
class Plan:
    stream: bool
    leave: bool


@attrs.define
class Outcome:
    plan: Plan
    sent: bool = False  # its body went out, so the server should count it
    left: bool = False  # it disconnected on purpose before the end
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None


@attrs.frozen
class Load:
    url: str
    clients: int = 16
    requests: int = 200
    duration_s: float = 60.0
    stream: float = 0.5
    leave: float = 0.2
    leave_after_s: float = 0.02
    max_tokens: int = 32
    request_timeout_s: float = 60.0
    settle_s: float = 10.0
    seed: int = 0


def plans(load: Load) -> Iterator[Plan]:
    rng = random.Random(load.seed)
    for _ in range(load.requests):
        yield Plan(stream=rng.random() < load.stream, leave=rng.random() < load.leave)


async def one(http: httpx.AsyncClient, load: Load, plan: Plan) -> Outcome:
    out = Outcome(plan)
    sent = asyncio.Event()

    async def trace(name: str, info: dict) -> None:
        if name == "http11.send_request_body.complete":
            out.sent = True
            sent.set()

    body = {"question": QUESTION, "stream": plan.stream,
            "settings": {"max_tokens": load.max_tokens, "temperature": 0.0}}
    start = time.perf_counter()
    try:
        async with asyncio.timeout(load.request_timeout_s):
            request = http.build_request("POST", f"{load.url}/v1/query", json=body,
                                         extensions={"trace": trace})
            if plan.stream:
                await _streamed(http, request, out, start)
            else:
                await _waited(http, request, out, sent, load.leave_after_s if plan.leave else None)
    except TimeoutError:
        out.error = "client timeout"
    except httpx.HTTPError as err:
        out.error = type(err).__name__
    if out.error is None and not out.left:
        out.latency_s = time.perf_counter() - start
    return out


async def _streamed(http: httpx.AsyncClient, request: httpx.Request, out: Outcome, start: float) -> None:
    # Closing the response before its body ends closes the connection: the
    # server sees the disconnect, as it would from a client that went away.
    response = await http.send(request, stream=True)
    try:
        out.status = response.status_code
        if response.status_code != 200:
            out.error = f"HTTP {response.status_code}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event.get("chunk") and out.ttft_s is None:
                out.ttft_s = time.perf_counter() - start
                if out.plan.leave:
                    out.left = True
                    return
            if event.get("completed"):
                return
        out.error = "stream ended before completed"
    finally:
        await response.aclose()


async def _waited(http: httpx.AsyncClient, request: httpx.Request, out: Outcome, sent: asyncio.Event,
                  leave_after_s: float | None) -> None:
    task = asyncio.ensure_future(http.send(request))
    if leave_after_s is not None:
        # Leave only once the body is out: a request never sent is one the
        # server never saw, and the count check would miss it for nothing.
        went = asyncio.ensure_future(sent.wait())
        await asyncio.wait({task, went}, return_when=asyncio.FIRST_COMPLETED)
        went.cancel()
        if not task.done():
            await asyncio.wait({task}, timeout=leave_after_s)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            out.left = True
            return
    response = await task
    out.status = response.status_code
    if response.status_code != 200:
        out.error = f"HTTP {response.status_code}"


async def client(http: httpx.AsyncClient, load: Load, todo: Iterator[Plan], deadline: float,
                 outcomes: list[Outcome]) -> None:
    while time.monotonic() < deadline:
        plan = next(todo, None)  # one iterator shared by all clients: the count bounds the loop
        if plan is None:
            return
        outcomes.append(await one(http, load, plan))


class Stats:
    """``/v1/stats``, read so that its own calls are left out of the count:
    a call is counted when it is answered, after it has read the counters."""

    def __init__(self, http: httpx.AsyncClient, url: str):
        self.http, self.url, self.calls = http, url, 0
        self.first: dict[str, Any] | None = None

    async def read(self) -> dict[str, Any]:
        response = await self.http.get(f"{self.url}/v1/stats")
        response.raise_for_status()
        self.calls += 1
        stats = response.json()
        self.first = self.first or stats
        return stats

    def counted_since_first(self, stats: dict[str, Any]) -> int:
        """Requests the server counted since the first read, less this one's own reads."""
        total = sum(stats["requests_by_status"].values()) - sum(self.first["requests_by_status"].values())
        return total - (self.calls - 1)


def checks(stats: Stats, last: dict[str, Any], sent: int) -> dict[str, bool]:
    pages, rows = last["kv_pages"], last["row_slots"]
    counted = stats.counted_since_first(last)
    return {f"every request sent was counted once by the server ({counted} of {sent})": counted == sent,
            f"no request still live ({last['live_requests']})": last["live_requests"] == 0,
            f"no request still queued ({last['queue_depth']})": last["queue_depth"] == 0,
            f"every KV page free again ({pages['free']} of {pages['total']})": pages["free"] == pages["total"],
            f"every row slot free again ({rows['free']} of {rows['total']})": rows["free"] == rows["total"]}


async def settle(stats: Stats, sent: int, within_s: float) -> dict[str, bool]:
    """Poll until every check holds or ``within_s`` has passed: a client's
    disconnect reaches the server a moment after the client has moved on."""
    deadline = time.monotonic() + within_s
    while True:
        result = checks(stats, await stats.read(), sent)
        if all(result.values()) or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.05)


async def run(load: Load) -> dict[str, Any]:
    host = urllib.parse.urlsplit(load.url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {host!r}")
    limits = httpx.Limits(max_connections=load.clients + 2, max_keepalive_connections=load.clients + 2)
    async with httpx.AsyncClient(limits=limits, timeout=load.request_timeout_s, trust_env=False) as http:
        model = (await http.get(f"{load.url}/health")).json().get("model", "?")
        stats = Stats(http, load.url)
        await stats.read()
        outcomes: list[Outcome] = []
        todo, start = plans(load), time.monotonic()
        await asyncio.gather(*(client(http, load, todo, start + load.duration_s, outcomes)
                               for _ in range(load.clients)))
        wall = time.monotonic() - start
        sent = sum(o.sent for o in outcomes)
        result = await settle(stats, sent, load.settle_s)
    return summary(load, outcomes, wall, model) | {"checks": result}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(load: Load, outcomes: list[Outcome], wall: float, model: str) -> dict[str, Any]:
    done = [o for o in outcomes if o.latency_s is not None]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    latency = [o.latency_s for o in done]
    return dict(model=model, clients=load.clients, requests=len(outcomes), wall_s=wall,
                completed=len(done), req_s=len(done) / wall if wall else 0.0,
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
    ap.add_argument("--url", default=d.url, help="the server (loopback only)")
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--requests", type=int, default=d.requests, help="at most this many, in all")
    ap.add_argument("--duration", type=float, default=d.duration_s, help="no request starts after this (s)")
    ap.add_argument("--stream", type=float, default=d.stream, help="share of requests that stream")
    ap.add_argument("--leave", type=float, default=d.leave, help="share of requests whose client leaves early")
    ap.add_argument("--leave-after", type=float, default=d.leave_after_s,
                    help="seconds a waiting client that leaves stays after sending")
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--timeout", type=float, default=d.request_timeout_s, help="one request's bound (s)")
    ap.add_argument("--settle", type=float, default=d.settle_s, help="bound on waiting for the server to settle (s)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default="", help="write the table into this file (docs/benchmarks.md)")
    args = ap.parse_args(argv)
    load = Load(url=args.url.rstrip("/"), clients=args.clients, requests=args.requests,
                duration_s=args.duration, stream=args.stream, leave=args.leave,
                leave_after_s=args.leave_after, max_tokens=args.max_tokens,
                request_timeout_s=args.timeout, settle_s=args.settle, seed=args.seed)
    result = asyncio.run(run(load))
    command = "python -m bubblefree.bench.load " + " ".join(sys.argv[1:] if argv is None else argv)
    result["text"] = (f"## Load through HTTP, {datetime.date.today()}\n\n"
                      f"Model: {result['model']}. Command: `{command.strip()}`. {load.clients} clients, "
                      f"{result['requests']} requests in {result['wall_s']:.1f} s; streams "
                      f"{load.stream:.0%}, clients leaving early {load.leave:.0%}. TTFT from streams only; "
                      "latency of requests that ran to the end.\n\n" + table(result) + "\n")
    print(result["text"])
    if args.out:
        write_block(Path(args.out), BEGIN, END, result["text"])
    return result


if __name__ == "__main__":
    sys.exit(0 if all(main()["checks"].values()) else 1)
