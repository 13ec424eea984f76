"""The load spread across several servers: client *i* always asks server
*i* mod *n*, and each server's clients run in a load process of their own.

Per client, not per request: each server then holds exactly its share of
the clients in flight, as behind a balancer that keeps a client's
connection on one server. Turning servers per request would let one
server's share drift above the other's from moment to moment, and a batch
that grows on one server while the other idles measures the turning, not
the servers. The cost: with fewer clients than servers, some servers get
none (1 client against 2 servers loads one of them).

A process per server: the load's own CPU grows with the servers, as a
fleet of clients' would, so two servers are never measured through one
Python loop that one server's load already keeps busy. The processes are
started once (spawn: the caller may hold threads, a fork would copy their
locks), each makes its images then, and every cell is handed to all of
them with one start time, so their timed windows are the same.

An address given more than once is shared: several load processes send to
it (one Ray Serve address in front of several replicas, whose load one
process cannot make), and this process checks it once for all of them,
reading ``/v1/stats`` before the cell and settling it after with the
requests they sent together.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any, Sequence

import attrs

import httpx

from bubblefree.bench.load import Load, Measured, Stats, measure, sent_and_left, settle, summary
from bubblefree.bench.load_images import pool

LEAD_S = 0.5  # from handing a cell out to its common start: each process reads /health and /v1/stats first


def split(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` in parts proportional to ``weights``, summing to ``total``."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights] if whole else [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i])[:total - sum(parts)]:
        parts[i] += 1
    return parts


def shares(clients: int, servers: int) -> list[int]:
    """Clients per server when client i asks server i mod ``servers``."""
    return [len(range(i, clients, servers)) for i in range(servers)]


def _drive(conn: Connection, images: int, side: int, seed: int) -> None:
    """A load process: make the images once, then measure each cell sent."""
    pictures = pool(images, side, seed) if images else []
    conn.send("ready")
    while (load := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(measure(load, pictures)))
        except BaseException as err:  # noqa: BLE001 - the parent reports it and stops
            conn.send(f"{type(err).__name__}: {err}")


class Spread:
    def __init__(self, urls: Sequence[str], *, images: int = 0, side: int = 378, seed: int = 0,
                 ready_s: float = 120.0):
        context = multiprocessing.get_context("spawn")
        self.urls = [u.rstrip("/") for u in urls]
        self._procs, self._conns = [], []
        for i, _ in enumerate(self.urls):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_drive, args=(theirs, images, side, seed + 1000 * i),
                                   name=f"bubblefree-load-{i}", daemon=True)
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        for conn in self._conns:
            _answer(conn, ready_s, "start")

    def run(self, load: Load) -> dict[str, Any]:
        """One cell, ``load.clients`` and ``load.requests`` shared out; the
        summary of all, each server's checks under its URL."""
        clients = shares(load.clients, len(self.urls))
        requests = split(load.requests, clients)
        shared = {u: Stats(None, u, load.replicas) for u in self.urls if self.urls.count(u) > 1}
        models = [asyncio.run(_read(stats, load.ready_s)) for stats in shared.values()]
        start_at = time.time() + LEAD_S
        busy = [i for i, c in enumerate(clients) if c]
        for i in busy:
            self._conns[i].send(attrs.evolve(load, url=self.urls[i], clients=clients[i], requests=requests[i],
                                             seed=load.seed + i, start_at=start_at,
                                             checked=self.urls[i] not in shared))
        bound = LEAD_S + load.duration_s + load.request_timeout_s + load.settle_s + 30
        parts: list[tuple[int, Measured]] = [(i, _answer(self._conns[i], bound, "measure")) for i in busy]
        for url, stats in shared.items():  # checked once, for every process that sent to it
            mine = [i for i, _ in parts if self.urls[i] == url]
            if not mine:
                continue
            sent = sent_and_left([o for i, m in parts if i in mine for o in m.outcomes])
            checked = asyncio.run(_settle(stats, sent, load.settle_s))
            parts = [(i, attrs.evolve(m, checks=checked) if i == mine[0] else m) for i, m in parts]
        outcomes = [o for _, m in parts for o in m.outcomes]
        rate = (sum(m.in_window for _, m in parts), max(m.window_s for _, m in parts))
        model = next((m.model for _, m in parts if m.model != "?"), models[0] if models else "?")
        result = summary(load, outcomes, max(m.wall_s for _, m in parts), model, rate)
        result["checks"] = {f"{self.urls[i]}: {name}": ok for i, m in parts for name, ok in m.checks.items()}
        result["servers"] = [dict(url=url, clients=clients[i],
                                  requests=next((len(m.outcomes) for j, m in parts if j == i), 0))
                             for i, url in enumerate(self.urls)]
        result["load_cpu"] = [round(m.cpu, 3) for _, m in parts]
        result["images_reused"] = sum(m.images_reused for _, m in parts)
        return result

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)

    def __enter__(self) -> "Spread":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _read(stats: Stats, ready_s: float) -> str:
    """The model a shared address serves, and its counters before the cell
    (of every replica behind it, within ``ready_s``)."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        stats.http = http
        model = (await http.get(f"{stats.url}/health")).json().get("model", "?")
        await stats.read_all(ready_s)
        return model


async def _settle(stats: Stats, sent: tuple[int, int], within_s: float) -> dict[str, bool]:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        stats.http = http
        return await settle(stats, sent[0], within_s, left_waiting=sent[1])


def _answer(conn: Connection, within_s: float, what: str) -> Any:
    if not conn.poll(within_s):
        raise RuntimeError(f"a load process did not {what} within {within_s:.0f} s")
    try:
        got = conn.recv()
    except EOFError:
        raise RuntimeError(f"a load process ended before it could {what}") from None
    if isinstance(got, str) and got != "ready":
        raise RuntimeError(f"a load process failed to {what}: {got}")
    return got
