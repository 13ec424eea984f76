"""Exhaustive bounded search: every interleaving of a small workload, driven
through the real core on the fake backend, every invariant checked in every
state.

Between two ticks the search branches on everything a caller or the device
could do (and, in "choice" mode, the engine: at the tick's end, leave the
step it finalized in flight for the next launch to go ahead of, or commit it
now, ``core/ahead.py``): which requests arrive now (and what each is: EOS at token 1..4,
never, or a constrained request whose skill cycles two masks), whether one
live request is cancelled now (queued, admitted, in flight, or a zombie's
last step pending), how long the step launched in this tick takes
(forward short or long, host copy prompt or delayed), and, where the bounds
ask for it, which device fault hits that step (at most one per path). A
timing or fault choice is only branched on when the tick did launch a step:
otherwise it changed nothing.

Depth first, snapshotting the world (``snapshot.Cloner``, a deep copy) at
each branch point (the last branch takes the original), deduplicating on the
abstract key of ``World.key``: the count reported is of distinct states.
A state reached again on the current path is a livelock; a path longer
than ``Bounds.max_ticks`` is one too. Every exception the core or the
simulated GPU raises (``HardwareMisuse``, ``KVCorruption``, an invariant
named by its id) is a violation, reported with the path that reached it.

    python -m tests.exhaustive [quick|ci|timings|faults|full|listeners] [modes...]

Modes: True (pipelined), False (blocking), "auto", "choice" (the oracle).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import sys
import time

import attrs

from bubblefree.core import InvariantViolation
from bubblefree.fake_backend import Fault

if __package__:  # python -m tests.exhaustive
    from tests.exhaustive_workload import EVENS, ODDS, TIMINGS, Bounds
    from tests.exhaustive_world import World
    from tests.snapshot import Cloner
else:  # imported by the tests, whose directory pytest puts on the path
    from exhaustive_workload import EVENS, ODDS, TIMINGS, Bounds
    from exhaustive_world import World
    from snapshot import Cloner

# Named bounds (docs/verification.md has their state counts):
#   quick      mutation runs, and the hand-broken invariants
#   ci         the test suite: the full workload, two timings per step (short
#              forward and prompt copy, or long forward and delayed copy)
#   timings    all four timings crossed, on a smaller workload
#   faults     one device fault of each kind, at any step
#   full       the full workload with all four timings (about a minute)
#   listeners  cancels also from a token listener (own request or another),
#              that is in the middle of a commit
#   mixed      run in "choice" mode: the oracle picks ahead or behind at the end
#              of every tick, on the timings workload with two timings
BOUNDS = {
    "quick": Bounds(requests=2, max_tokens=3, last_arrival=1, eos=(0, 1, 2), timings=("fast", "slow"),
                    num_pages=4, max_rows=2, max_prefill_tokens=4),
    "ci": Bounds(timings=("fast", "slow")),
    "timings": Bounds(last_arrival=1, eos=(0, 2, 4)),
    "faults": Bounds(last_arrival=1, eos=(0, 2, 4), timings=("fast",),
                     faults=("launch", "finalize", "sampling", "copy")),
    "full": Bounds(),
    "listeners": Bounds(last_arrival=1, eos=(0, 2, 4), timings=("fast",), listener_cancels=True),
    "mixed": Bounds(last_arrival=1, eos=(0, 2, 4), timings=("fast", "slow")),
}


@attrs.define
class Report:
    pipelined: bool | str
    states: int = 0
    edges: int = 0
    terminals: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    violations: list[tuple[str, tuple]] = attrs.Factory(list)  # (message, path)
    probes: set[str] = attrs.Factory(set)

    def line(self) -> str:
        mode = {True: "pipelined", False: "blocking "}.get(self.pipelined, self.pipelined)
        return (f"{mode}: {self.states} states, {self.edges} edges, {self.terminals} terminal, "
                f"depth {self.max_depth}, {len(self.violations)} violations, {self.seconds:.1f}s")


@attrs.define(eq=False)
class Probe:
    """The rare situations reached; shared by every snapshot, never copied."""

    seen: set[str] = attrs.Factory(set)

    def __call__(self, situation: str) -> None:
        self.seen.add(situation)


def _moves(world: World, requests: tuple) -> list[tuple[tuple, int | None, bool | None, str, str | None]]:
    """(arrivals, cancel, ahead, timing, fault) choices before the next tick;
    ``ahead`` is the oracle's choice at the tick's end (None outside "choice"
    mode; with no work, the tick launches nothing and both are one)."""
    b = world.bounds
    oracle = hasattr(world.engine, "oracle") and (world.engine.has_work() or world.arrivals_open())
    aheads = (True, False) if oracle else (None,)
    if world.arrivals_open():
        left = b.requests - len(world.handles)
        counts = range(left + 1) if world.tick_no < b.last_arrival else (left,)
    else:
        counts = (0,)
    out = []
    for k in counts:
        for arrivals in itertools.product(range(len(requests)), repeat=k):
            cancels: list = [None]
            if world.cancels_left:
                live = world.live() + list(range(len(world.handles), len(world.handles) + k))
                cancels += live
                if b.listener_cancels:
                    cancels += [(x, by) for by in live for x in live]
            faults = (None, *b.faults) if world.faults_left else (None,)
            out.extend((arrivals, c, a, t, f) for c in cancels for a in aheads for t in b.timings for f in faults)
    return out


def _step(world: World, requests: tuple, move: tuple) -> tuple[bool, bool]:
    """Apply one move and one tick; returns (progressed, launched a step)."""
    arrivals, cancel, ahead, timing, fault = move
    for i in arrivals:
        world.submit(requests[i])
    if cancel is not None:
        world.cancel(cancel)
        world.check_state()
    s = world.engine.scheduler
    before, trace_from = s._next_step, len(world.engine.trace)
    inflight = [st.step_id for st in s.inflight]
    compute_free = world.backend.clock.compute.free_at
    world.backend.timing = TIMINGS[timing]
    world.backend.faults = {before: Fault(fault, f"{fault} fault")} if fault else {}
    if hasattr(world.engine, "oracle"):
        world.engine.oracle = ahead  # None: the engine's own choice
    had_work = world.engine.has_work()
    progressed = world.engine.tick()
    if progressed != had_work:  # tick() is False exactly when there was nothing to do
        raise InvariantViolation("deadlock: tick() did nothing with work pending" if had_work
                                 else "tick() reported progress with nothing to do")
    world.backend.faults = {}
    world.tick_no += 1
    world.check_tick(trace_from, inflight)
    world.check_device(compute_free)
    world.check_state()
    # History only (nothing reads it again): dropped so snapshots stay small.
    world.engine.trace.clear()
    world.backend.log.clear()
    world.backend.clock.compute.intervals.clear()
    world.backend.clock.copy.intervals.clear()
    launched = s._next_step != before
    world.faults_left -= bool(fault and launched)
    return progressed, launched


@attrs.define(eq=False)
class _Frame:
    world: World
    key: tuple
    path: tuple
    moves: list
    next: int = 0
    skip: tuple | None = None  # (arrivals, cancel, ahead) whose other timings and faults change nothing


def search(bounds: Bounds = Bounds(), pipelined: bool | str = True, max_violations: int = 20) -> Report:
    """Every state reachable within ``bounds``; each one checked (World.check_*)."""
    report = Report(pipelined)
    started = time.perf_counter()
    probe = Probe()
    root = World.new(bounds, pipelined, probe)
    mask_ids = (root.engine.register_mask(EVENS), root.engine.register_mask(ODDS))
    requests = bounds.contents(mask_ids)
    shared = [probe, bounds, root.backend.model, *TIMINGS.values(), *requests]
    _explore(root, requests, shared, report, max_violations)
    report.seconds = time.perf_counter() - started
    report.probes = probe.seen
    return report


def _explore(root: World, requests: tuple, shared: list, report: Report, max_violations: int) -> None:
    bounds = root.bounds
    cloner = Cloner()

    def violation(err: str, path: tuple) -> None:
        report.violations.append((err, path))

    seen = {root.key()}
    on_path = {root.key()}
    stack = [_Frame(root, root.key(), (), _moves(root, requests))]
    while stack and len(report.violations) < max_violations:
        frame = stack[-1]
        if frame.next == len(frame.moves):
            stack.pop()
            on_path.discard(frame.key)
            continue
        move = frame.moves[frame.next]
        frame.next += 1
        if move[:3] == frame.skip:
            continue
        last = frame.next == len(frame.moves)
        child = frame.world if last else cloner.copy(frame.world, shared)
        path = frame.path + (move,)
        report.edges += 1
        try:
            progressed, launched = _step(child, requests, move)
        except Exception as err:  # an invariant, a device misuse, an illegal move, a crash
            violation(f"{type(err).__name__}: {err}", path)
            frame.skip = move[:3]
            continue
        if not launched:
            frame.skip = move[:3]  # no step was launched, so its timing and fault changed nothing
        key = child.key()
        if key in on_path:
            violation("livelock: a state repeats on one path", path)
        elif key not in seen:
            seen.add(key)
            report.max_depth = max(report.max_depth, len(path))
            if child.terminal():
                report.terminals += 1
                try:
                    child.check_terminal()
                except Exception as err:
                    violation(f"{type(err).__name__}: {err}", path)
            elif len(path) > bounds.max_ticks:
                violation(f"livelock: no end after {len(path)} ticks", path)
            else:
                on_path.add(key)
                stack.append(_Frame(child, key, path, _moves(child, requests)))
    report.states = len(seen)


def search_modes(bounds: Bounds, parallel: bool = True, modes: tuple = (True, False)) -> list[Report]:
    """Each mode's search (pipelined and blocking by default), each in its
    own process when ``parallel``."""
    if not parallel:
        return [search(bounds, mode) for mode in modes]
    with concurrent.futures.ProcessPoolExecutor(len(modes), mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(search, (bounds,) * len(modes), modes))


def main(argv: list[str]) -> int:
    name = argv[0] if argv else "ci"
    bounds = BOUNDS[name]
    modes = tuple({"True": True, "False": False}.get(m, m) for m in argv[1:]) or (True, False)
    print(f"{name}: {bounds}")
    bad = 0
    for report in search_modes(bounds, modes=modes):
        print(report.line())
        print("  rare situations reached:", ", ".join(sorted(report.probes)))
        for message, path in report.violations:
            bad += 1
            print("  VIOLATION", message, "\n    path:", path)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
