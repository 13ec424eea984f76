"""The speed benchmark's pieces: workloads, a timed backend, one closed-loop run.

Workloads (every prompt is 32 random token ids; greedy unless said):

    text    110 new tokens, no stop token (the peers' workload)
    sampled text drawn at temperature 0.7 and top_p 0.9 (``SAMPLED``,
            common chat settings; the peers draw with the same); not in the
            default grid
    detect  a constrained cycle over three disjoint token-id ranges standing
            in for x, y and size bins, 150 tokens; the state says "done" after
            the 150th, two short of the cap, so the engine learns of the end
            only at commit (a random model has no location tokens, so masks
            over id ranges are the honest stand-in for the detect skill)
    point   3 constrained tokens (x, y, end), cap 4: a stream of prefills
            with a little decode
    mix     the three interleaved, request by request

``TimedBackend`` is a ``CudaBackend`` with an optional timing hook: CUDA
events on the compute stream around each launch's forward and each
finalize's sampling, and host clocks around launch and wait. Nothing is read
back until the run is over, so the hook adds no synchronization.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import random
import statistics
import threading
import time
from collections import defaultdict

import attrs
import torch

from bubblefree.bench.speed_report import behind_summary, timings_summary
from bubblefree.core import Engine, Request, SamplePlan, SamplingParams, Status, StepFailed
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.slots import SlotState

PROMPT = 32
FULL_TOKENS = {"text": 110, "detect": 150, "point": 3}
QUICK_TOKENS = {"text": 12, "detect": 15, "point": 3}
WORKLOADS = ("text", "detect", "point", "mix", "sampled")
DEFAULT_WORKLOADS = WORKLOADS[:4]
SAMPLED = {"temperature": 0.7, "top_p": 0.9}  # the sampled workload's, its peers' too (speed_report.notes words it)


@attrs.define
class Cycle:
    """A constrained decode state: ``ids`` in turn, done after ``length``."""

    ids: tuple[int, ...]
    length: int
    n: int = 0

    def mask_id(self) -> int:
        return self.ids[self.n % len(self.ids)]

    def advance(self, token: int, value: float | None) -> bool:
        self.n += 1
        return self.n >= self.length

    def may_end(self) -> bool:
        """Only the last token ends it, as a skill knows its end (auto mode)."""
        return self.n + 1 >= self.length


def bin_masks(vocab: int) -> tuple[frozenset[int], ...]:
    """Three disjoint id ranges at the top of the vocabulary (x, y, size)."""
    k = vocab // 8
    return tuple(frozenset(range(vocab - (3 - i) * k, vocab - (2 - i) * k)) for i in range(3))


def make_requests(kind: str, count: int, tokens: dict[str, int], mask_ids: tuple[int, ...],
                  vocab: int, seed: int) -> list[Request]:
    """``count`` requests of workload ``kind``; the same list for every mode."""
    rng = random.Random(f"{kind}/{seed}")
    out = []
    for i in range(count):
        what = ("text", "detect", "point")[i % 3] if kind == "mix" else kind
        prompt = tuple(rng.randrange(vocab) for _ in range(PROMPT))
        if what == "sampled":
            out.append(Request(prompt=prompt, max_tokens=tokens["text"], stop_ids=frozenset(),
                               sampling=SamplingParams(**SAMPLED, seed=i)))
            continue
        n = tokens[what]
        if what == "text":
            out.append(Request(prompt=prompt, max_tokens=n, stop_ids=frozenset()))
        else:
            cap = n + (2 if what == "detect" else 1)
            out.append(Request(prompt=prompt, max_tokens=cap, stop_ids=frozenset(),
                               decode_state=functools.partial(Cycle, mask_ids, n)))
    return out


def request_count(kind: str, streams: int, quick: bool) -> int:
    """Requests per cell: enough for a steady state, bounded for the time
    budget. A point request is 3 tokens, so it takes 16 a stream: at 4, a
    run at 64 streams was about 13 ticks, mostly the ramp and the drain
    (docs/performance.md, run 24)."""
    if quick:
        return {"point": max(2 * streams, 8), "mix": max(streams, 3)}.get(kind, max(streams, 2))
    return {"point": max(16 * streams, 48), "mix": max(3 * streams, 6)}.get(kind, max(2 * streams, 4))


class TimedBackend(CudaBackend):
    """CudaBackend plus a timing hook that is off unless ``recording``.

    The start event of a launch is recorded after the host has packed the
    step's metadata (the runner's pack functions are wrapped), so host work
    done while the GPU waits counts as idle, not as GPU time. Masks are
    registered once: a new Engine on this backend gets the same ids back.
    """

    def __init__(self, *args, **kwargs):
        self.recording = False
        self._mask_ids: dict[frozenset[int], int] = {}
        self.reset_stats()
        super().__init__(*args, **kwargs)
        for name in ("pack_decode", "pack_prefill"):
            setattr(self._runner, name, self._restart_after(getattr(self._runner, name)))

    def reset_stats(self) -> None:
        self.intervals: list[list] = []  # [start event, end event] on the compute stream
        self.launch_marks: list[tuple[float, float]] = []  # (host clock, wait total) per launch
        self.wait_total = 0.0

    def register_mask(self, allowed: frozenset[int]) -> int:
        allowed = frozenset(allowed)
        if allowed not in self._mask_ids:
            self._mask_ids[allowed] = super().register_mask(allowed)
        return self._mask_ids[allowed]

    def launch(self, slot, plan) -> None:
        if self.recording:
            self.launch_marks.append((time.perf_counter(), self.wait_total))
        super().launch(slot, plan)

    def wait(self, slot):
        t = time.perf_counter()
        try:
            return super().wait(slot)
        finally:
            self.wait_total += time.perf_counter() - t

    def _on(self, stream):
        stack = super()._on(stream)
        if self.recording and stream is not None and stream is self._compute:
            pair = [self._event(), None]
            self.intervals.append(pair)
            stack.callback(self._close, pair)
        return stack

    def _event(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self._compute)
        return ev

    def _close(self, pair: list) -> None:
        pair[1] = self._event()

    def _restart_after(self, pack):
        def wrapped(*args, **kwargs):
            out = pack(*args, **kwargs)
            if self.recording and self.intervals and self.intervals[-1][1] is None:
                self.intervals[-1][0] = self._event()  # the GPU's work starts after packing
            return out
        return wrapped

    def repair(self) -> None:
        """After a failed run: take every busy slot the rest of the contract's
        way to FREE (finalize, wait, release), so no buffer is handed back
        while a copy may still land in it (I4). The engine that launched these
        steps is dropped, so an unconstrained sampling is as good as any; a
        step that fails on the way is FAILED, which release takes."""
        self.recording = False
        for s in self._slots:
            with contextlib.suppress(StepFailed):
                if s.state is SlotState.LAUNCHED:
                    self.finalize(s.index, SamplePlan(s.plan.step_id, (None,) * len(s.plan.rows)))
                if s.state is SlotState.FINALIZED:
                    self.wait(s.index)
            if s.state is not SlotState.FREE:
                self.release(s.index)
        self._sync()

    def gpu_times(self) -> tuple[float, float] | None:
        """(busy ms, idle ms) on the compute stream over the recorded run."""
        if self._compute is None or not self.intervals:
            return None
        torch.cuda.synchronize(self.device)
        spans = [(a, b) for a, b in self.intervals if b is not None]
        busy = sum(a.elapsed_time(b) for a, b in spans)
        idle = sum(max(0.0, spans[i - 1][1].elapsed_time(spans[i][0])) for i in range(1, len(spans)))
        return busy, idle

    def bookkeeping_ms(self) -> float | None:
        """Host ms between launch calls, minus time blocked in wait, per step."""
        m = self.launch_marks
        if len(m) < 2:
            return None
        return ((m[-1][0] - m[0][0]) - (m[-1][1] - m[0][1])) / (len(m) - 1) * 1e3


def zombie_stats(trace: list[tuple], ntokens: dict[int, int]) -> tuple[int, int, int]:
    """(steps, zombie rows, steps whose rows are all zombies) from a trace.

    Every launched row commits one token unless its sequence had already
    ended; a sequence's surplus rows are its last ones."""
    rows: dict[int, int] = {}
    seq_steps: dict[int, list[int]] = defaultdict(list)
    for e in trace:
        if e[0] == "launch":
            rows[e[1]] = len(e[4])
            for sid in e[4]:
                seq_steps[sid].append(e[1])
    zombies: dict[int, int] = defaultdict(int)
    for sid, steps in seq_steps.items():
        for st in steps[ntokens.get(sid, 0):]:
            zombies[st] += 1
    wasted = sum(1 for st, n in rows.items() if zombies[st] == n)
    return len(rows), sum(zombies.values()), wasted


class Collections:
    """The garbage collections (any thread, any generation) while entered:
    how many, and the seconds they took. A full collection of a process
    serving a model takes about 100 ms on a CPU: inside a run it is a stall
    of every stream, and it shows here and not in the host's own work."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        self._started: dict[int, float] = {}

    def _seen(self, phase: str, info: dict) -> None:
        now, thread = time.perf_counter(), threading.get_ident()
        if phase == "start":
            self._started[thread] = now
        elif thread in self._started:
            self.count += 1
            self.seconds += now - self._started.pop(thread)

    def __enter__(self) -> "Collections":
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._seen)


def run_closed_loop(backend: TimedBackend, requests: list[Request], streams: int,
                    pipelined: bool | str, record: bool) -> dict:
    """Keep ``streams`` requests in flight until all are done; measure."""
    engine = Engine(backend, pipelined=pipelined)
    for allowed in list(backend._mask_ids):  # the backend hands back the ids it already has
        engine.register_mask(allowed)
    finished, submitted_at, latency = [], {}, []

    def on_end(handle, token):
        if token is None:
            finished.append((handle, time.perf_counter()))

    def submit(req):
        h = engine.submit(req)
        submitted_at[h.request_id] = time.perf_counter()
        h.listeners.append(on_end)

    backend.reset_stats()
    backend.recording = record
    budget = 20 * sum(r.max_tokens + 2 for r in requests) + 1000
    todo = list(reversed(requests))
    done, ticks, results = 0, 0, []
    start = time.perf_counter()
    try:
        with Collections() as collected:
            while todo and len(submitted_at) < streams:
                submit(todo.pop())
            while done < len(requests):
                if not engine.tick():
                    raise RuntimeError(f"engine idle with {len(requests) - done} requests unfinished")
                ticks += 1
                if ticks > budget:
                    raise RuntimeError(f"no end after {ticks} ticks")
                while finished:
                    h, t = finished.pop()
                    latency.append(t - submitted_at[h.request_id])
                    results.append(h.result)
                    done += 1
                    if todo:
                        submit(todo.pop())
            engine.run_until_idle(max_ticks=16)  # zombies still in flight
            wall = time.perf_counter() - start
    finally:
        backend.recording = False
    bad = [r for r in results if r.status is not Status.COMPLETED]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not complete: {bad[0].finish_reason}")
    ntokens = {r.request_id: len(r.tokens) for r in results}
    steps, zombie_rows, wasted = zombie_stats(engine.trace, ntokens)
    tokens = sum(ntokens.values())
    out = dict(requests=len(results), tokens=tokens, wall_s=wall, steps=steps,
               tok_s=tokens / wall, req_s=len(results) / wall, ms_step=wall / steps * 1e3,
               zombie_rows=zombie_rows, wasted_steps=wasted, z=wasted / steps,
               # Where each run's steps went on the host, in every run (the
               # timing hook's idle and busy are the last run's only): blocked
               # in wait (the device's step, or its copy), the host's own
               # work (the rest), auto's choosing inside that, and garbage
               # collections; per step, ms.
               wait_ms=backend.wait_total / steps * 1e3,
               host_ms=(wall - backend.wait_total) / steps * 1e3,
               choose_ms=engine.choose_host / steps * 1e3,
               gc_count=collected.count, gc_ms=collected.seconds * 1e3,
               ahead_ticks=engine.ahead_ticks, behind_ticks=engine.behind_ticks,
               unweighed_ticks=engine.unweighed_ticks,
               behind_why=behind_summary(engine.behind), timings=timings_summary(engine),
               p50_ms=statistics.median(latency) * 1e3, p99_ms=_quantile(latency, 0.99) * 1e3,
               tokens_hash=hash(tuple(r.tokens for r in sorted(results, key=lambda r: r.request_id))),
               # A fresh engine numbers requests in submission order: the list's.
               tokens_by_request=[r.tokens for r in sorted(results, key=lambda r: r.request_id)])
    if record:
        gpu = backend.gpu_times()
        if gpu is not None:
            out.update(busy_ms=gpu[0] / steps, idle_ms=gpu[1] / steps)
        out["bookkeeping_ms"] = backend.bookkeeping_ms()
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
