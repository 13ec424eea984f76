"""Launch ahead or not: the per-tick choice of ``Engine(pipelined="auto")``.

Each auto tick is the seed's pipelined tick, launch t+1, commit t (none if
the last tick committed its step), finalize t+1; at its end the Engine
chooses::

    ahead    leave t+1 in flight: the next tick launches t+2 before it
             commits t+1 (pipelined)
    behind   commit t+1 now: its ends reach the caller, and the next tick
             plans t+2 after them, as blocking does

Behind is blocking's order with respect to the caller too: a caller that
answers an end with its next request (a closed loop, in a listener or
between ticks) has it in the next launch, as in blocking. Committing first
and launching in the same tick, before delivery, made those requests miss
the step, and on the simulated GPU auto then lost to both modes on skills
that end often (0.70-0.75 of the better at 8 streams, ``bench.auto_sim``).

The choice changes timing only, never what is committed (I8): masks are
built after the commit in both (I9), and a row that ends at t+1 is a zombie
of t+2 only when t+2 was launched first, which the refcounts already keep
safe (I3, I6). The exhaustive search and the state machine let an oracle
make the choice at every tick, so every policy is covered at once.

The rule. Call the step the tick finalized u and the next tick's step v.
Launching v ahead of u's commit hides the bubble, ``b``: the host time from
a commit's copy arriving to the next forward's launch (commit bookkeeping,
planning, the launch call). It costs a row's share of a forward, ``F / n``
for a step of ``n`` rows and ``F`` the device time of a step, for each row
that ends at u: one that v takes is a zombie there, and one whose caller
answers its end with a next request (a closed loop) sees that request
miss v, planned before the end reached it. So::

    ahead  iff  z == 0  or  b >= F * z / n

``z`` sums, over u's rows that may end there (a stop id its mask allows,
or a skill whose ``may_end()`` says so), that skill's measured rate of
ending when it may at that token of its output (``EndRates``: a point's
first token may be the end of an empty list and rarely is, its last
always is), weighted 1 for a row v takes and, for the others, by
the measured share of ends followed by a new request before the next
launch (``Successors``: an HTTP client's next request comes too late to
matter, an in-process loop's does not); ``n`` is u's row count.
A row at its last token (the length cap) surely ends and makes no zombie
(it is not planned again: ``policy``): it weighs the share alone, and
teaches no skill's rate. No row can end: ahead, never worse. Every row
surely ends (rate 1): ahead only when the bubble is at least a whole
forward, i.e. when the zombie step runs entirely inside time the host
spends anyway.

``b`` also holds, where the caller of another row answers an end with
its next request, that request's prefill launch call beyond a decode
launch's, by the share of v's rows still live (``weighed_bubble``):
behind, the next launch is that prefill's, with nothing in flight; ahead,
v's live rows advance under it. An image prefill's call is 2.5-7 ms of
host time on moondream2 against 0.2-1.4 for a decode's at 8 streams
(docs/performance.md, "Auto on images"). Requests already handed over
for a prefill make v that prefill (``_taken``), whether the scheduler
holds them yet or the serving loop's inbox still does (``arrivals``): on
moondream2's images at 8 streams the callers' threads hand theirs in
while the decode thread waits on the device, and a rule blind to the
inbox foresaw a decode holding the ending rows as zombies, went behind,
and left the device idle through that prefill's launch call
(docs/performance.md, "Point on images at 8 streams, span by span").

The choice has a cost of its own: ``choose`` asks each of u's rows whether
it may end, 0.05-0.07 ms a tick at 64 rows of a skill on the H200's host,
where a step that the host paces takes 1.3 ms and the choice made it
pipelined's 0.94-0.96. ``Worth`` weighs that cost against what the choices
bought (``bought``: a behind choice's zombie share of a forward, less the
bubble it left open); where they bought under an eighth of it, a tick is
weighed with chance one in eight and otherwise launches ahead unweighed,
which changes timing only (I8), as any choice does.

Pure and torch-free: the Engine measures with the clock it was given and
hands this module numbers (``ahead_measures``: the end rates, the callers'
follow share, the host and device times, and what choices bought).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Mapping, NamedTuple

import attrs

from bubblefree.core.ahead_measures import POSITIONS, EndRates
from bubblefree.core.policy import PREFILLS
from bubblefree.core.sequence import ENDED, Sequence
from bubblefree.core.values import StepKind, shown

if TYPE_CHECKING:
    from bubblefree.core.scheduler import Scheduler

MODES = (True, False, "auto")  # ``Engine.pipelined``: always ahead, never (blocking), chosen per tick


def check_mode(mode: object) -> None:
    if not any(mode is m if isinstance(m, bool) else mode == m for m in MODES):
        raise ValueError(f'pipelined: must be True, False or "auto", got {shown(mode)}')


def launch_ahead(rows: int, zombies: float, bubble: float, forward: float) -> bool:
    """The rule above: True to launch the next step before committing the last."""
    if rows <= 0 or zombies <= 0:
        return True
    return bubble >= forward * min(zombies, rows) / rows


# u's rows that may end, by (skill, token position): their seq ids in row
# order. Grouped, a tick's arithmetic and learning run per key (one or two
# at 64 rows of one workload), not per row.
May = dict[tuple[Hashable, int], list[int]]

# The bounds in ``choose`` decide only past this relative margin, so that
# rounding can never make them disagree with the whole outlook's sum.
MARGIN = 1e-9


def outlook(sched: "Scheduler", rates: EndRates, follow: float = 0.0,
            arrivals: int = 0) -> tuple[int, float, May]:
    """What the core knows at the end of a tick, without the device: the row
    count of the uncommitted step u, the expected cost in rows of launching
    the next step v ahead of its commit (the rule's ``z``: each row of u that
    may end, by its skill's rate at that token, weighted 1 where v takes it
    and ``follow`` elsewhere; ``follow`` for each row at its last token), and
    u's rows that may end (``May``, for ``EndRates``). ``arrivals``:
    requests handed over and not yet submitted (``_taken``). Pure: it plans
    nothing and admits nobody."""
    pending = _pending(sched)
    if pending is None:
        return 0, 0.0, {}
    rows, may, last = pending
    if not may:  # the common tick of a skill that ends at known tokens: no need to foresee v
        return rows, last * follow, {}
    return rows, _zombies(_rates(rates, may), follow, may, last, _taken(sched, arrivals)), may


class Choice(NamedTuple):
    """``choose``'s answer: ``ahead`` or not, u's rows that may end, u's
    row count, the ``zombies`` the answer rests on (``outlook``'s ``z``
    where the choice foresaw v, else the bound that decided it: at least
    ``z`` where ahead, at most where behind) and the ``bubble`` it weighed
    them against (``weighed_bubble``). ``launch_ahead(rows, zombies,
    bubble, forward)`` gives ``ahead``."""

    ahead: bool
    may: May
    rows: int = 0
    zombies: float = 0.0
    bubble: float = 0.0


def weighed_bubble(bubble: float, prefill_extra: float, follow: float, ends: float, rows: int) -> float:
    """The bubble launching ahead hides at this tick: ``bubble``, and where
    a caller answers an end with its next request, what that request's
    prefill launch call takes beyond a decode launch's (``prefill_extra``),
    by the share of v's rows still live, ``(rows - ends) / rows`` for
    ``ends`` expected among u's ``rows``, and by the chance that a caller
    of another row answers, ``min(1, follow * ends * (rows - 1) / rows)``.
    Behind, that call runs with nothing in flight; ahead, v runs under it,
    and only its live rows make that time count: a step of zombies alone
    advances nobody, and a row's own end leaves it no live row to hide
    behind (one stream)."""
    if rows <= 0 or prefill_extra <= 0:
        return bubble
    others = min(1.0, follow * ends * (rows - 1) / rows)
    return bubble + others * prefill_extra * max(0.0, rows - ends) / rows


def choose(sched: "Scheduler", rates: EndRates, follow: float, bubble: float,
           forward: float, prefill_extra: float = 0.0, arrivals: int = 0) -> Choice:
    """``launch_ahead`` of ``outlook``'s rows and ``z`` against the
    ``weighed_bubble``, and u's rows that may end: the same answer, found
    with less host work, which at 64 rows is what a host-bound step is made
    of. ``z`` lies between its value with every row that may end weighted
    ``min(1, follow)`` and with every one weighted ``max(1, follow)``, and
    the rule is monotone in ``z``: where both bounds give the same answer
    (past ``MARGIN``), which rows v takes cannot change it, and v is not
    foreseen (``Scheduler.preview`` looks at every sequence). The expected
    ends (each row that may end by its rate, each at its last token 1) do
    not depend on v. ``arrivals``: requests handed over and not yet
    submitted (``_taken``)."""
    pending = _pending(sched)
    if pending is None:
        return Choice(True, {}, bubble=bubble)
    rows, may, last = pending
    if not may:
        bubble = weighed_bubble(bubble, prefill_extra, follow, last, rows)
        return Choice(launch_ahead(rows, last * follow, bubble, forward), {}, rows, last * follow, bubble)
    rate = _rates(rates, may)
    weighed = sum(rate[key] * len(sids) for key, sids in may.items())  # every row weighted 1
    bubble = weighed_bubble(bubble, prefill_extra, follow, weighed + last, rows)
    lo, hi = min(1.0, follow), max(1.0, follow)
    most = weighed * hi + last * follow
    if launch_ahead(rows, most * (1 + MARGIN), bubble, forward):
        return Choice(True, may, rows, most, bubble)
    least = weighed * lo + last * follow
    if not launch_ahead(rows, least * (1 - MARGIN), bubble, forward):
        return Choice(False, may, rows, least, bubble)
    z = _zombies(rate, follow, may, last, _taken(sched, arrivals))
    return Choice(launch_ahead(rows, z, bubble, forward), may, rows, z, bubble)


def _pending(sched: "Scheduler") -> tuple[int, May, int] | None:
    """u's row count, its rows that may end, and its rows at their last
    token; None when nothing is in flight or no slot is free for v."""
    if not sched.inflight or sched.pool.free_slot() is None:
        return None
    step = sched.inflight[-1]  # u: with a slot free, the only step in flight
    seqs, masks = sched.seqs, sched.masks
    may: May = {}
    group, ended, cap = may.get, ENDED, POSITIONS
    last = 0
    # Every row at every tick, so kept lean: at 64 rows this loop is most of
    # auto's host work over pipelined's. u was finalized: its masks are set.
    for sid, mask_id in zip(step.seq_ids, step.mask_ids, strict=True):
        s = seqs.get(sid)
        if s is None or s.phase in ended:  # ended or cancelled (``finalized``): it ends at no commit
            continue
        request, at = s.request, len(s.tokens)  # u's token is the row's only one uncommitted
        if at + 1 >= request.max_tokens:
            last += 1  # u's token is its last: it surely ends, and v does not take it (``policy``)
            continue
        if request.stop_ids:
            # Unmasked, a stop id may come: ``may_end``'s True without the call.
            if mask_id is not None and not may_end(s, mask_id, masks):
                continue
        elif s.state is None or not _skill_may_end(s.state):  # ``may_end`` without a stop id
            continue  # (neither a stop id nor a skill: only the length cap ends it)
        key = (request.skill, at if at < cap else cap)
        sids = group(key)
        if sids is None:
            may[key] = [sid]
        else:
            sids.append(sid)
    return len(step.seq_ids), may, last


def _taken(sched: "Scheduler", arrivals: int = 0) -> set[int]:
    """The seq ids the next decode step would take (none if a prefill is
    next). Requests not yet admitted, queued or handed over and not yet
    submitted (``arrivals``), make a prefill next as ``policy.choose_step``
    alternates: while a row slot is free for them, and unless the last
    launch was a prefill (its rows decode next). Pages they might lack go
    unchecked: a misjudged tick costs time, never a token (I8)."""
    if (arrivals > 0 or sched.queue) and sched.rows.num_free > 0 \
            and sched._last_kind not in PREFILLS:
        return set()
    chosen = sched.preview()
    return {s.seq_id for s in chosen[1]} if chosen is not None and chosen[0] is StepKind.DECODE else set()


def _rates(rates: EndRates, may: May) -> dict[tuple[Hashable, int], float]:
    return {key: rates.rate(*key) for key in may}


def _zombies(rate: dict[tuple[Hashable, int], float], follow: float, may: May, last: int,
             taken: set[int]) -> float:
    """The rule's ``z``: each row that may end by its skill's ``rate`` at
    its token, weighted 1 where v takes it and ``follow`` elsewhere, and
    ``follow`` for each of the ``last`` rows at their last token."""
    z = 0.0
    for key, sids in may.items():
        took = sum(1 for sid in sids if sid in taken)
        z += rate[key] * (took + follow * (len(sids) - took))
    return z + last * follow


def may_end(s: Sequence, mask_id: int | None, masks: Mapping[int, frozenset[int]]) -> bool:
    """Can the token the pending step samples for ``s`` end it? A stop id its
    mask allows, or a skill whose optional ``may_end()`` says so (absent:
    True). A raise here counts as True and nothing else: this is timing only,
    and the modes must agree on outputs (I8)."""
    stops = s.request.stop_ids
    if stops and (mask_id is None or mask_id not in masks or not stops.isdisjoint(masks[mask_id])):
        return True
    return s.state is not None and _skill_may_end(s.state)  # no skill and no stop id: it cannot end


def _skill_may_end(state: Any) -> bool:
    """A skill's own ``may_end()``; True where it does not say, or raises."""
    try:
        ask: Any = getattr(state, "may_end", None)  # a property may raise too
        return True if ask is None else bool(ask())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - the skill's bug shows where it fails its request
        return True


@attrs.frozen
class Behind:
    """The rule's inputs at a tick that chose behind: u's ``rows``, the
    expected ``zombies`` its answer rests on (``Choice``: ``outlook``'s
    ``z``, or at most it where the bound decided), the ``bubble`` and
    ``forward`` it weighed them against (host-clock seconds), and the
    callers' ``follow`` share. ``launch_ahead(rows, zombies, bubble,
    forward)`` is False for each: what a user reads to see why auto blocked
    where it did."""

    rows: int
    zombies: float
    bubble: float
    forward: float
    follow: float
