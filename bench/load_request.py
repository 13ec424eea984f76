"""One request of the load, as moondream's client sends it, timed: the
first piece of a stream, the end of any request; or its client leaving on
purpose, once the body is out (a request never sent is one the server never
saw, and the count check would miss it for nothing)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import attrs
import httpx

if TYPE_CHECKING:
    from bubblefree.bench.load import Load

QUESTION = "What is the cat on?"
OBJECT = "the red car"


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
    ended: float | None = None  # time.monotonic() when it ran to the end


def body(load: Load, plan: Plan, image: str | None) -> dict[str, Any]:
    """What moondream's client posts for the workload (greedy)."""
    if load.workload == "point":
        out: dict[str, Any] = {"object": OBJECT, "settings": {"temperature": 0.0, "max_objects": 1}}
    else:
        out = {"question": QUESTION, "stream": plan.stream,
               "settings": {"max_tokens": load.max_tokens, "temperature": 0.0}}
    if image is not None:
        out["image_url"] = image
    return out


async def one(http: httpx.AsyncClient, load: Load, plan: Plan, image: str | None = None) -> Outcome:
    out = Outcome(plan)
    sent = asyncio.Event()

    async def trace(name: str, info: dict) -> None:
        if name == "http11.send_request_body.complete":
            out.sent = True
            sent.set()

    start = time.perf_counter()
    try:
        async with asyncio.timeout(load.request_timeout_s):
            request = http.build_request("POST", f"{load.url}/v1/{load.workload}",
                                         json=body(load, plan, image), extensions={"trace": trace})
            if plan.stream:
                await _streamed(http, request, out, start)
            else:
                await _waited(http, request, out, sent, load.leave_after_s if plan.leave else None)
    except TimeoutError:
        out.error = "client timeout"
    except httpx.HTTPError as err:
        out.error = type(err).__name__
    if out.error is None and not out.left:
        out.latency_s, out.ended = time.perf_counter() - start, time.monotonic()
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
