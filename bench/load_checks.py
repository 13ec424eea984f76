"""After the load: did the server get everything back? ``/v1/stats`` read
before and after, and polled until it settles or a bound passes.

One address's view. Behind several servers each is checked on its own
against the requests sent to it (``bench/load_spread.py``). Behind one
address that fronts several replicas (``serve --replicas N`` on Ray Serve),
a ``/v1/stats`` call reaches one replica, named by the answer's
``X-Bubblefree-Replica`` header: the reads are kept per replica, repeated
until each of the *replicas* has answered, and the checks add the counts up
and hold every replica to them. Behind such a relay, a client that leaves
while it waits may be gone before any replica had its request (Ray's proxy
drops the call, and no engine ever saw it): such requests may be missing
from the count, and only they, and the check's name says how many left so.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import attrs
import httpx

REPLICA_HEADER = "x-bubblefree-replica"  # bubblefree.server.replicas names it; that module needs Ray
READS_PER_REPLICA = 24  # the reads a round makes back to back per replica to reach them all
# Then a round goes on reading, spaced, for up to this long: Ray Serve's
# router may keep sending to one replica while its cached queue length for
# another is stale (its cache lives 10 s), however many reads are made.
ROUND_S = 12.0


@attrs.define
class Seen:
    """One replica's ``/v1/stats``: the first answer, the latest, and how
    many of this checker's calls it answered."""
    first: dict[str, Any]
    last: dict[str, Any]
    calls: int = 1


def _total(stats: dict[str, Any]) -> int:
    return sum(stats["requests_by_status"].values())


class Stats:
    """``/v1/stats`` behind ``url``, read so that its own calls are left out
    of the count: a call is counted when it is answered, after it has read
    the counters."""

    def __init__(self, http: httpx.AsyncClient | None, url: str, replicas: int = 1):
        """``http``: the client to read with; None until one is set (a
        checker that reads from several event loops sets one for each)."""
        if replicas < 1:
            raise ValueError(f"replicas: at least 1, got {replicas}")
        self.http, self.url, self.replicas = http, url, replicas
        self.seen: dict[str, Seen] = {}
        self.fresh = 0  # replicas the latest round reached
        self.before: int | None = None  # replicas reached before the load (``read_all``)

    @property
    def relayed(self) -> bool:
        """The answers name a replica: a relay fronts the replicas."""
        return any(self.seen) and "" not in self.seen

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.seen.values())

    async def read_one(self) -> tuple[str, dict[str, Any]]:
        response = await self.http.get(f"{self.url}/v1/stats")
        response.raise_for_status()
        stats = response.json()
        name = response.headers.get(REPLICA_HEADER, "")
        if (seen := self.seen.get(name)) is None:
            self.seen[name] = Seen(stats, stats)
        else:
            seen.last, seen.calls = stats, seen.calls + 1
        return name, stats

    async def read(self, within_s: float = ROUND_S) -> dict[str, Any]:
        """A round: every replica's stats read afresh, back to back, then
        spaced until ``within_s`` has passed (a replica not reached keeps
        its older answer, and ``checks`` says so). Reads are one at a time:
        each counts the ones before it. Returns the first answer of the
        round."""
        fresh: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + within_s
        reads = 0
        while len(fresh) < self.replicas:
            if reads >= READS_PER_REPLICA * self.replicas:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.25)
            name, stats = await self.read_one()
            fresh.setdefault(name, stats)
            reads += 1
        self.fresh = len(fresh)
        return next(iter(fresh.values()))

    async def read_all(self, within_s: float) -> None:
        """The reads before the load: rounds until every replica has
        answered or ``within_s`` has passed. A replica still starting when
        the address first answers gets no calls from the relay until it is
        up; counted from a later first read, the requests it served before
        it would be missing, so ``checks`` says how many were reached."""
        deadline = time.monotonic() + within_s
        await self.read(min(within_s, ROUND_S))
        while len(self.seen) < self.replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            await self.read(min(within_s, ROUND_S))
        self.before = len(self.seen)

    def counted_since_first(self) -> int:
        """Requests counted since each replica's first read, less these reads
        (a replica counts each of them but its latest)."""
        return sum(_total(s.last) - _total(s.first) - (s.calls - 1) for s in self.seen.values())


def checks(stats: Stats, sent: int, *, left_waiting: int = 0) -> dict[str, bool]:
    """``sent``: requests whose body went out; ``left_waiting``: those of
    them whose client left before any answer came."""
    counted, seen = stats.counted_since_first(), list(stats.seen.values())
    lasts = [s.last for s in seen]
    live = sum(s["live_requests"] for s in lasts)
    queued = sum(s["queue_depth"] for s in lasts)
    pages = [sum(s["kv_pages"][k] for s in lasts) for k in ("free", "total")]
    rows = [sum(s["row_slots"][k] for s in lasts) for k in ("free", "total")]
    if stats.relayed:
        count = (f"every request sent was counted once by a replica, but for clients that left waiting "
                 f"before one had it ({counted} of {sent}; {left_waiting} left waiting)",
                 sent - left_waiting <= counted <= sent)
    else:
        count = (f"every request sent was counted once by the server ({counted} of {sent})", counted == sent)
    result = {count[0]: count[1],
              f"no request still live ({live})": live == 0,
              f"no request still queued ({queued})": queued == 0,
              f"every KV page free again ({pages[0]} of {pages[1]})": pages[0] == pages[1],
              f"every row slot free again ({rows[0]} of {rows[1]})": rows[0] == rows[1]}
    if stats.replicas > 1:
        if stats.before is not None:
            result[f"every replica read before the load ({stats.before} of {stats.replicas})"] = (
                stats.before == stats.replicas)
        result[f"every replica read ({len(seen)} of {stats.replicas}, {stats.fresh} in the last round)"] = (
            len(seen) == stats.replicas == stats.fresh)
    return result


async def settle(stats: Stats, sent: int, within_s: float, *, left_waiting: int = 0) -> dict[str, bool]:
    """Poll ``checks`` until every one holds or ``within_s`` has passed: a
    client's disconnect reaches the server a moment after the client has
    moved on."""
    deadline = time.monotonic() + within_s
    while True:
        await stats.read(min(within_s, ROUND_S))
        result = checks(stats, sent, left_waiting=left_waiting)
        if all(result.values()) or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.05)
