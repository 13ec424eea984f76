"""After the load: did the server get everything back? ``/v1/stats`` read
before and after, and polled until it settles or a bound passes.

One server's view: behind several servers, each is checked on its own
against the requests sent to it (``bench/load_spread.py``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx


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
