"""Where one image request's wall time goes at one stream, by host thread
and backend call: the caller's preparation, each step kind's ``launch``,
the ``wait`` for a step's output (the host idle while the device works),
``finalize``, ``release``, and what is left (the serving loop's own Python,
thread hand-offs, the API).

    python -m bubblefree.bench.vlm_timeline [--workloads point,query] [--requests 24]
        [--side 378] [--modes auto,True,False] [--tiny] [--trace K] [--crops-on-host]
        [--streams N [--rounds R]]

Requests one after another (one stream), each on a fresh image; every
backend call and the caller's image preparation timed on the host
(``time.perf_counter``) by wrapping them, no profiler. Per request, each
kind of call's time inside the request's window (from the API call to its
return), mean over the requests. ``submit`` is the caller's submit less
the crops (``image_ref``) inside it; ``tick`` the decode thread's ticks less
the backend calls inside them (the core's and skills' Python); ``rest`` is
the window less all of them (hand-offs between the threads, the loop's
idle wake-up, the answer's conversion). The hand-offs are given apart: from
the caller's submit returning to the decode thread taking the request
(``gather`` and ``take``, the core's submit, are inside it), and from the
end's delivery to the caller's call returning. Garbage collections (any
thread) are summed apart; ``--trace`` also shows the decode thread's idle
waits on the loop's condition and each notify of it.
On CUDA each line also gives the device window per request: the device
clock's time from before the first request to after the last (CUDA
events), divided by the requests, idle time included.

With ``--streams N`` (N > 1), N client threads ask at once, as
``bench.vlm_speed``'s cells do, and a request's window no longer holds one
request's work alone. Each line then sums every span of the run, per kind
and thread (the decode thread's backend calls, ticks, hand-offs and idle
waits; the callers' submits and crops), divided by the requests; gives the
image prefills' count and rows, auto's ticks ahead and behind (with the
medians of what the rule weighed at its behind ticks), and the run's
req/s. ``--rounds R`` runs the modes R times in the order A B C C B
A, each run its own line, so that what moves with the mode can be told
from what moves between runs.
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics
import threading
import time
from typing import Any, Callable

import torch

from bubblefree.bench.speed_report import behind_summary
from bubblefree.bench.vlm_speed import WORKLOADS, images, run_cell

CALLS = ("launch", "wait", "finalize", "release")
APART = ("delivered", "idle", "notify", "gc")  # marks and spans shown in a trace, not in the parts


class TimedCondition:
    """The serving loop's condition, with the decode thread's waits kept as
    ``idle`` spans and each notify as a mark."""

    def __init__(self, inner: threading.Condition, spans: list):
        self._inner, self._spans = inner, spans

    def __enter__(self) -> Any:
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    def wait(self, timeout: float | None = None) -> bool:
        start = time.perf_counter()
        try:
            return self._inner.wait(timeout)
        finally:
            self._spans.append(("idle", start, time.perf_counter()))

    def notify(self, n: int = 1) -> None:
        now = time.perf_counter()
        self._spans.append(("notify", now, now))
        self._inner.notify(n)


class Recorder:
    """Wraps the backend's calls and the image preparation; keeps (what,
    start, end) spans."""

    def __init__(self, engine: Any):
        self.spans: list[tuple[str, float, float]] = []
        self.kinds: dict[int, str] = {}  # slot -> the kind launched into it
        self.launched: list[tuple[str, int]] = []  # (kind, rows) of each launch
        backend = engine.backend
        for name in (*CALLS, "image_ref"):
            setattr(backend, name, self._wrap(name, getattr(backend, name)))
        # Around the calls above: the caller's submit (image_ref inside it)
        # and the decode thread's tick (every backend step call inside it).
        engine.submit_many = self._wrap("submit", engine.submit_many)
        core = engine.loop.core  # slotted: its class is swapped for one whose tick is timed
        timed_tick = self._wrap("tick", type(core).tick)
        core.__class__ = type("TimedCore", (type(core),), {"__slots__": (), "tick": timed_tick})
        # The hand-offs between the threads: the decode thread's gather and
        # take of a submit (outside any tick), and the end's delivery to the
        # caller's handle (inside a tick).
        loop = engine.loop
        loop._gather = self._wrap("gather", loop._gather)
        loop._take = self._wrap("take", loop._take)
        forward = loop._forward
        loop._forward = lambda handle: self._delivered(forward(handle))
        # Marks beside the spans (``APART``): the decode thread's idle waits
        # and the callers' notifies, on the loop's condition; and each
        # garbage collection, on whichever thread ran it.
        loop._wake = TimedCondition(loop._wake, self.spans)
        self._loop = loop
        self._gc_start: dict[int, float] = {}
        gc.callbacks.append(self._collected)

    def close(self) -> None:
        gc.callbacks.remove(self._collected)

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        thread, now = threading.get_ident(), time.perf_counter()
        if phase == "start":
            self._gc_start[thread] = now
        elif thread in self._gc_start:
            who = "decode" if self._loop.on_loop_thread else "caller"
            self.spans.append((f"gc{info['generation']} {who}", self._gc_start.pop(thread), now))

    def _delivered(self, deliver: Callable) -> Callable:
        def timed(core_handle: Any, token: int | None) -> None:
            deliver(core_handle, token)
            if token is None:
                self.spans.append(("delivered", time.perf_counter(), time.perf_counter()))
        return timed

    def _wrap(self, name: str, call: Callable) -> Callable:
        def timed(*args: Any) -> Any:
            if name == "launch":
                self.kinds[args[0]] = args[1].kind.value
                self.launched.append((args[1].kind.value, len(args[1].rows)))
            what = (name if name in ("image_ref", "release", "submit", "tick", "gather", "take")
                    else f"{name} {self.kinds.get(args[0], '?')}")
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                self.spans.append((what, start, time.perf_counter()))
        return timed


def within(spans: list[tuple[str, float, float]], start: float, end: float) -> dict[str, float]:
    """Seconds of each kind of span inside [start, end]."""
    out: dict[str, float] = collections.defaultdict(float)
    for what, a, b in spans:
        if b > start and a < end:
            out[what] += min(b, end) - max(a, start)
    return out


HAND_OFFS = ("to decode thread", "to caller")


def hand_offs(spans: list[tuple[str, float, float]], start: float, end: float) -> dict[str, float]:
    """Seconds from the caller's submit returning to the decode thread taking
    it, and from the end's delivery to the caller's call returning (both
    include whatever else the threads ran meanwhile: they are the spans the
    other parts leave as rest)."""
    inside = [s for s in spans if s[1] >= start and s[2] <= end]
    submitted = min((b for w, a, b in inside if w == "submit"), default=start)
    taken = min((a for w, a, b in inside if w == "take" and a >= submitted), default=submitted)
    delivered = max((b for w, a, b in inside if w == "delivered"), default=end)
    return {"to decode thread": taken - submitted, "to caller": end - delivered}


def trace(spans: list[tuple[str, float, float]], windows: list[tuple[float, float]]) -> list[str]:
    """The spans of ``windows`` in order of start, in ms from the first
    window's start; the caller's thread runs ``image_ref`` and ``submit``,
    the decode thread everything else."""
    t0, t1 = windows[0][0], windows[-1][1]
    lines = [f"{1e3 * (a - t0):9.2f} {1e3 * (b - t0):9.2f}  {w}"
             for w, a, b in sorted(spans, key=lambda s: s[1]) if b >= t0 and a <= t1]
    lines += [f"{1e3 * (a - t0):9.2f} {1e3 * (b - t0):9.2f}  == request" for a, b in windows]
    return sorted(lines, key=lambda line: float(line.split()[0]))


def measure(engine: Any, recorder: Recorder, workload: str, side: int, count: int,
            traced: int = 0) -> dict[str, Any]:
    ask = WORKLOADS[workload]
    for picture in images(4, side, 99):
        ask(engine, picture)  # warm
    pictures = images(count, side, 7)
    recorder.spans.clear()
    recorder.launched.clear()
    windows = []
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    for picture in pictures:
        start = time.perf_counter()
        ask(engine, picture)
        windows.append((start, time.perf_counter()))
    device_ms = None
    if cuda:
        finish.record()
        torch.cuda.synchronize()
        device_ms = begin.elapsed_time(finish) / count  # wall on the device's clock, idle included
    parts = [within(recorder.spans, a, b) for a, b in windows]
    handoffs = [hand_offs(recorder.spans, a, b) for a, b in windows]
    walls = [1e3 * (b - a) for a, b in windows]
    collected = []
    for p in parts:  # the outer spans less what they hold: their own Python
        apart = {k: p.pop(k) for k in list(p) if k.split()[0] in APART or k.startswith("gc")}
        collected.append(sum(v for k, v in apart.items() if k.startswith("gc")))
        p["submit"] = p.get("submit", 0.0) - p.get("image_ref", 0.0)
        p["tick"] = p.get("tick", 0.0) - sum(v for k, v in p.items() if k.split()[0] in CALLS)
    names = sorted({k for p in parts for k in p})
    mean = {k: 1e3 * statistics.mean(p.get(k, 0.0) for p in parts) for k in names}
    mean["rest"] = statistics.mean(walls) - sum(mean.values())
    return dict(workload=workload, wall_p50=statistics.median(walls), wall_mean=statistics.mean(walls),
                parts=mean, device_window_ms=device_ms, gc_ms=1e3 * statistics.mean(collected),
                trace=trace(recorder.spans, windows[-traced:]) if traced else [],
                handoffs={k: 1e3 * statistics.mean(h[k] for h in handoffs) for k in HAND_OFFS},
                calls={k: statistics.mean(sum(1 for w, a, b in recorder.spans if w == k and a >= s and b <= e)
                                          for s, e in windows) for k in names})


DECODE_THREAD = ("tick", "gather", "take", "idle", "release", *CALLS)


def measure_streams(engine: Any, recorder: Recorder, workload: str, side: int, count: int,
                    streams: int, seed: int) -> dict[str, Any]:
    """``streams`` callers over ``count`` fresh images: every span of the
    run summed per kind, in ms per request (the decode thread's own time:
    ``tick`` less the backend calls inside it, ``submit`` less the crops),
    the image prefills' count and rows, auto's ticks."""
    run_cell(engine, workload, images(2 * streams, side, seed + 99), streams)  # warm
    core = engine.core
    before = (core.ahead_ticks, core.behind_ticks, core.unweighed_ticks)
    recorder.spans.clear()
    recorder.launched.clear()
    start = time.perf_counter()
    cell = run_cell(engine, workload, images(count, side, seed), streams)
    parts = within(recorder.spans, start, time.perf_counter())
    parts.pop("notify", None)
    parts.pop("delivered", None)
    parts["submit"] = parts.get("submit", 0.0) - parts.get("image_ref", 0.0)
    parts["tick"] = parts.get("tick", 0.0) - sum(v for k, v in parts.items() if k.split()[0] in CALLS)
    prefills = [rows for kind, rows in recorder.launched if kind == "image_prefill"]
    new = min(core.behind_ticks - before[1], len(core.behind))
    why = behind_summary(list(core.behind)[len(core.behind) - new:])
    return dict(workload=workload, req_s=cell["req_s"], p50_ms=cell["p50_ms"], why=why,
                parts={k: 1e3 * v / count for k, v in parts.items()},
                prefills=len(prefills) / count, prefill_rows=statistics.mean(prefills) if prefills else 0.0,
                decodes=sum(1 for kind, _ in recorder.launched if kind == "decode") / count,
                ahead=core.ahead_ticks - before[0], behind=core.behind_ticks - before[1],
                unweighed=core.unweighed_ticks - before[2])


def show_streams(mode: str, streams: int, r: dict[str, Any]) -> str:
    def listed(keys):
        return ", ".join(f"{k} {v:.2f}" for k, v in sorted(keys, key=lambda kv: -kv[1]))
    own = [(k, v) for k, v in r["parts"].items() if k.split()[0] in DECODE_THREAD]
    callers = [(k, v) for k, v in r["parts"].items() if k.split()[0] not in DECODE_THREAD]
    why = r.get("why")
    weighed = "" if not why else (
        f" (medians there: rows {why['rows']:g}, zombies {why['zombies']:.2f}, follow "
        f"{why['follow']:.2f}, bubble {why['bubble_ms']:.2f} ms, zombie cost "
        f"{why['zombie_cost_ms']:.2f} ms)")
    return (f"{r['workload']:7s} pipelined={mode:5s} x{streams}: {r['req_s']:.1f} req/s, p50 "
            f"{r['p50_ms']:.1f} ms; image prefills {r['prefills']:.2f} a request of "
            f"{r['prefill_rows']:.2f} rows, decode steps {r['decodes']:.2f} a request; ticks "
            f"ahead {r['ahead']}, behind {r['behind']}{weighed}, unweighed {r.get('unweighed', 0)}; decode thread, ms a request: "
            f"{listed(own)}; callers, ms a request (all threads): {listed(callers)}")


def show(mode: str, r: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v:.2f}" + (f" (x{r['calls'][k]:.1f})" if k in r["calls"] else "")
                      for k, v in sorted(r["parts"].items(), key=lambda kv: -kv[1]))
    hand = ", ".join(f"{k} {v:.2f}" for k, v in r["handoffs"].items())
    device = "" if r["device_window_ms"] is None else f"; device window {r['device_window_ms']:.2f} ms"
    return (f"{r['workload']:7s} pipelined={mode:5s} wall p50 {r['wall_p50']:.2f} ms, mean "
            f"{r['wall_mean']:.2f} ms; per request, ms (calls): {parts}; hand-offs, ms: {hand}; "
            f"garbage collection {r['gc_ms']:.2f} ms{device}")


def prepare_ms(engine: Any, side: int, reps: int = 20) -> str:
    """The caller's crops alone: as served (on CUDA, resized and cut on the
    device, back into pinned memory), then by Pillow into pinned and into
    pageable memory."""
    from bubblefree.cuda_backend.moondream.prepared import prepare

    pictures, backend = images(reps, side, 11), engine.backend
    vision, stream = backend.config.vision, backend._crop_stream
    ways = [("on the device", True, stream)] if stream is not None else []
    if torch.cuda.is_available():
        ways.append(("Pillow, pinned", True, None))
    ways.append(("Pillow, pageable", False, None))
    out = []
    for name, pin, on in ways:
        prepare(pictures[0], vision, pin, on)
        start = time.perf_counter()
        for picture in pictures:
            prepare(picture, vision, pin, on)
        out.append(f"{name} {1e3 * (time.perf_counter() - start) / reps:.2f} ms")
    return f"crops of a {side}-px image on the caller's thread, alone: " + ", ".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="point,query")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--side", type=int, default=378)
    ap.add_argument("--modes", default="auto,True,False", help="the engine's pipelined setting, each in turn")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (a CPU smoke run)")
    ap.add_argument("--crops-on-host", action="store_true",
                    help="callers' images resized and cut by Pillow on their threads, not on the GPU "
                    "(MoondreamBackend's crops_on_device=False)")
    ap.add_argument("--trace", type=int, default=0, metavar="K",
                    help="also print every timed span of the last K requests of each line")
    ap.add_argument("--streams", type=int, default=1,
                    help="client threads asking at once (more than one: the run's spans summed)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --streams: the modes this many times, A B C C B A")
    args = ap.parse_args(argv)
    if args.streams < 1 or args.rounds < 1:
        ap.error(f"--streams and --rounds must be at least 1, not {args.streams} and {args.rounds}")
    if args.streams > 1 and args.trace:
        ap.error("--trace shows one request's spans: it needs --streams 1")
    from bubblefree import Engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine.moondream_random("tiny" if args.tiny else "full", device=device,
                                     crops_on_device=not args.crops_on_host)
    recorder = Recorder(engine)
    print(f"prefill: {engine.backend.prefill_path}", flush=True)
    print(prepare_ms(engine, args.side), flush=True)
    try:
        if args.streams > 1:
            modes = args.modes.split(",")
            order = [m for i in range(args.rounds) for m in (modes if i % 2 == 0 else modes[::-1])]
            for workload in args.workloads.split(","):
                for i, mode in enumerate(order):
                    engine.pipelined = {"True": True, "False": False}.get(mode, mode)
                    result = measure_streams(engine, recorder, workload, args.side, args.requests,
                                             args.streams, seed=7 + 1000 * i)
                    print(show_streams(mode, args.streams, result), flush=True)
            return
        for mode in args.modes.split(","):
            engine.pipelined = {"True": True, "False": False}.get(mode, mode)
            for workload in args.workloads.split(","):
                result = measure(engine, recorder, workload, args.side, args.requests, args.trace)
                print(show(mode, result), flush=True)
                print("\n".join(result["trace"]), flush=True)
    finally:
        recorder.close()
        engine.close()


if __name__ == "__main__":
    main()
