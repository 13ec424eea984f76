"""What the launch-ahead rule weighs (``core.ahead``), measured as the
Engine runs: how often a skill's rows end where they may (``EndRates``),
how often a caller answers an end with its next request (``Successors``),
the host's bubble and a step's device time (``Timings``), and whether a
tick's choice is worth the host time it takes (``Worth``, from what each
choice ``bought``). Each is a running tally or mean, fed numbers by the
Engine with the clock it was given: pure and torch-free.
"""

from __future__ import annotations

import collections
import random
from typing import TYPE_CHECKING, Callable, Hashable

import attrs

from bubblefree.core.values import StepKind

if TYPE_CHECKING:
    from bubblefree.core.ahead import Choice

SMOOTHING = 0.2  # weight of the newest sample in each running mean
POSITIONS = 8  # end rates per token position up to here; later positions share this one (``EndRates``)
PRIOR = 2.0  # a position's end rate starts at its skill's, as if from this many chances
# The choice weighs its own host time (``Worth``): after WARMUP choices, where
# what they bought is under 1/WORTH of what they cost, a tick is weighed with
# chance SAMPLE and otherwise goes ahead unweighed. GAIN_SMOOTHING: the
# weight of the newest choice in the mean of what choices bought (the plain
# mean until there are as many), slow because a behind tick may come once in
# hundreds.
WARMUP, WORTH, SAMPLE, GAIN_SMOOTHING = 16, 8.0, 1 / 8, 1 / 64


@attrs.define
class EndRates:
    """Per skill (``Request.skill``, None for plain requests): how often a row
    that may end at a step did end there, over all its tokens, and at each
    token position (the output's first ``POSITIONS``; later ones share one).
    A structured answer's chances differ by position: an object list's
    first token may end an empty list and, where objects are found, does
    not; its last object's last token always does. Pooled, the two made
    one half, and auto blocked before every first token for nothing.

    The pooled rate starts at one half (a prior of one end in two chances);
    a position's starts at the pooled rate (a prior of ``PRIOR`` chances
    ending at it), so a new position or skill learns within a few steps."""

    counts: dict[Hashable, tuple[int, int]] = attrs.Factory(dict)  # skill -> (ended, chances)
    at: dict[tuple[Hashable, int], tuple[int, int]] = attrs.Factory(dict)  # (skill, position) -> the same

    def rate(self, skill: Hashable, position: int | None = None) -> float:
        ended, chances = self.counts.get(skill, (0, 0))
        pooled = (ended + 1) / (chances + 2)
        if position is None:
            return pooled
        ended, chances = self.at.get((skill, position), (0, 0))
        return (ended + PRIOR * pooled) / (chances + PRIOR)

    def record(self, skill: Hashable, ended: bool, position: int | None = None) -> None:
        self.add(skill, position, int(ended), 1)

    def add(self, skill: Hashable, position: int | None, ended: int, chances: int) -> None:
        """``chances`` at once, ``ended`` of them ended: a tick's rows, tallied."""
        e, c = self.counts.get(skill, (0, 0))
        self.counts[skill] = (e + ended, c + chances)
        if position is not None:
            e, c = self.at.get((skill, position), (0, 0))
            self.at[skill, position] = (e + ended, c + chances)


def _mean(old: float | None, sample: float, weight: float = SMOOTHING) -> float:
    return sample if old is None else old + weight * (sample - old)


def bought(choice: Choice, forward: float) -> float:
    """What a choice saved over launching ahead unweighed: nothing where it
    chose ahead; where it chose behind, the zombie share of a forward it
    avoided less the bubble it left open (``launch_ahead``'s two sides)."""
    if choice.ahead or choice.rows <= 0:
        return 0.0
    return max(0.0, forward * min(choice.zombies, choice.rows) / choice.rows - choice.bubble)


@attrs.define
class Worth:
    """Is this tick's choice worth the host time it takes? At 64 rows of a
    skill ``choose`` asks every row whether it may end: 0.05-0.07 ms a tick
    on the H200's host, 4-5% of a host-bound step of Qwen2-0.5B's detect,
    where a behind tick came once in 300 and bought about 0.1 ms
    (docs/performance.md, "Auto weighs its own cost"). After ``WARMUP``
    choices, where the mean of what they ``bought`` is under 1/``WORTH`` of
    their mean host time, a tick is weighed with chance ``SAMPLE`` and
    otherwise launches ahead unweighed (the pipelined order: outputs are
    the same, I8). The loss is bounded: a skipped tick loses at most what
    a choice buys on average, under an eighth of what it costs. The draw
    is random, from this Engine's own seeded stream, so that no workload
    of a fixed period hides its behind ticks from the sample; the rates
    (``EndRates``) learn from the weighed ticks only, and a workload whose
    ends become likely makes its sampled choices buy more, which weighs
    every tick again."""

    rng: random.Random = attrs.Factory(lambda: random.Random(0))
    cost: float | None = None  # host seconds a choice takes (running mean)
    gain: float = 0.0  # host-clock seconds a choice bought (``bought``; slow running mean)
    weighed: int = 0

    def weigh(self) -> bool:
        if self.weighed < WARMUP or self.cost is None or self.gain * WORTH >= self.cost:
            return True
        return self.rng.random() < SAMPLE

    def record(self, host: float, gain: float) -> None:
        self.weighed += 1
        self.cost = _mean(self.cost, host)
        self.gain = _mean(self.gain, gain, max(GAIN_SMOOTHING, 1 / self.weighed))


@attrs.define
class Successors:
    """How often the caller answers an end with a new request before the
    next launch: a running mean, per launch that had ends before it, of the
    requests submitted since (at most one per end) over those ends. Starts
    at one half. Counts submissions, not their cause: arrivals that would
    have come anyway count too, which leans the rule towards behind only
    where rows are likely to end."""

    rate: float = 0.5
    ends: int = 0  # ended since the last launch
    submitted: int = 0  # requests submitted since the last launch

    def launching(self) -> None:
        if self.ends:
            self.rate = _mean(self.rate, min(self.submitted, self.ends) / self.ends)
        self.ends = self.submitted = 0


@attrs.define
class Timings:
    """Host-clock measurements, fed by the Engine around its backend calls,
    per step kind: the rule weighs a decode step (the only step that can
    hold zombies), and an image prefill's device time (ten decode steps'
    on moondream2) or launch call would skew a mean over all kinds.

    ``bubble`` = commit host time (after the copy arrived) + a decode
    launch's host time (planning and the launch call). ``forward`` = a
    decode step's device time: from the later of its launch and the
    previous copy's arrival to its own copy's arrival (behind, the launch
    comes later; ahead, the device ran the steps back to back, so the gap
    between arrivals is one step), less what launch calls of other kinds
    in that gap took beyond a decode launch's own: an image prefill's
    launch call (1.3-1.5 ms on moondream2 against 0.15-0.2 for a decode
    step's) delayed the arrival the host saw, not the decode step, and
    counted in it, leaned the rule behind where pipelined was the better
    (``bench.auto_sim --prefill-launch 9``: 64 of 72 cells, 71 without)."""

    clock: Callable[[], float]
    commit_host: float | None = None
    launch_hosts: dict[StepKind, float] = attrs.Factory(dict)
    # A prefill's launch call, whatever its kind (a caller's next request
    # needs one): the running mean over every launch that is not a decode's.
    prefill_launch: float | None = None
    forwards: dict[StepKind, float] = attrs.Factory(dict)
    _arrived: float | None = None  # when the last copy arrived (``wait`` returned)
    _launched: dict[int, tuple[float, StepKind]] = attrs.Factory(dict)  # step id -> (launch returned, kind)
    # The latest launch calls, (started, returned, kind): enough to cover the
    # gap between two arrivals (at most two steps are in flight).
    _calls: collections.deque = attrs.Factory(lambda: collections.deque(maxlen=8))

    @property
    def launch_host(self) -> float | None:
        return self.launch_hosts.get(StepKind.DECODE)

    @property
    def forward(self) -> float | None:
        return self.forwards.get(StepKind.DECODE)

    @property
    def bubble(self) -> float:
        return (self.commit_host or 0.0) + (self.launch_host or 0.0)

    @property
    def prefill_extra(self) -> float:
        """What a prefill's launch call takes beyond a decode's (``weighed_bubble``);
        0 until both were measured."""
        if self.prefill_launch is None or self.launch_host is None:
            return 0.0
        return max(0.0, self.prefill_launch - self.launch_host)

    def launched(self, step_id: int, started: float, kind: StepKind = StepKind.DECODE) -> None:
        now = self.clock()
        self.launch_hosts[kind] = _mean(self.launch_hosts.get(kind), now - started)
        if kind is not StepKind.DECODE:
            self.prefill_launch = _mean(self.prefill_launch, now - started)
        self._launched[step_id] = (now, kind)
        self._calls.append((started, now, kind))

    def arrived(self, step_id: int) -> float:
        now = self.clock()
        launched = self._launched.pop(step_id, None)
        if launched is not None:
            at, kind = launched
            start = at if self._arrived is None else max(at, self._arrived)
            own = self.launch_hosts.get(kind, 0.0)
            other = sum(max(0.0, min(end, now) - max(began, start) - own)
                        for began, end, k in self._calls if k is not kind)
            self.forwards[kind] = _mean(self.forwards.get(kind), max(0.0, now - start - other))
        self._arrived = now
        return now

    def committed(self, arrived: float) -> None:
        self.commit_host = _mean(self.commit_host, self.clock() - arrived)

    def forget(self, step_id: int | None = None) -> None:
        """A step that will never arrive (failed); None: every step (aborted)."""
        if step_id is None:
            self._launched.clear()
        self._launched.pop(step_id, None)
