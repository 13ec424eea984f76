"""The exhaustive bounded search (tests/exhaustive.py) as tests.

Every state reachable within the bounds, in pipelined and blocking mode (and
on "mixed", with an oracle choosing each tick's order, and in auto mode), is
checked for every invariant; every path must end with each request ended
exactly once, nothing in flight and every page free. The floors are state
counts measured for these bounds: a search that silently explores less (a
broken move generator, a key that merges too much) fails here, and
test_invariant_breaks.py shows that a search this size catches a broken core.
"""

from __future__ import annotations

import itertools
import random

import pytest

from bubblefree.core import InvariantViolation, ahead
from exhaustive import BOUNDS, Probe, search_modes
from exhaustive_workload import EVENS, ODDS
from exhaustive_world import World
from snapshot import Cloner

# Distinct states measured (pipelined, blocking), less about a tenth: a floor
# that a search exploring less than it should falls through, with room for
# the core to change its bookkeeping.
FLOORS = {"quick": (290, 70), "ci": (9450, 2600), "timings": (5500, 1050), "faults": (11500, 3900),
          "listeners": (3350, 2150), "mixed": (9800, 3100)}
# (mixed's second figure is auto's own choices: 4,366 states while the rule
# let a row at its last token go ahead, 3,477 since it weighs that certain
# end; the choice oracle's 11,712 explore every policy either way)

# The seed's hazards: each must be reached, or the search proves little.
RARE_PIPELINED = {
    "zombie_commit_skipped", "zombie_last_commit_frees_pages", "two_steps_in_flight_for_one_sequence",
    "both_slots_busy", "stop_with_successor_launched", "done_with_successor_launched", "cancel_in_flight",
    "prefill_launched_while_decode_in_flight", "queued_for_pages", "queued_for_adapters", "admitted_after_waiting",
    "image_prefill_launched_while_decode_in_flight", "decode_launched_after_an_uncommitted_value",
}


# The modes each bound runs: pipelined and blocking, or, on "mixed", the
# choice oracle (ahead or behind at every tick: every policy's mixed ticks)
# beside the auto rule itself.
MODES = {"mixed": ("choice", "auto")}


@pytest.mark.parametrize("name", ["quick", "ci", "timings", "faults", "listeners", "mixed"])
def test_exhaustive_search_finds_no_violation(name):
    reports = search_modes(BOUNDS[name], parallel=name != "quick", modes=MODES.get(name, (True, False)))
    for report, floor in zip(reports, FLOORS[name]):
        print(report.line())
        assert not report.violations, "\n".join(f"{m}\n  path: {p}" for m, p in report.violations[:5])
        assert report.states >= floor, f"the search explored only {report.states} states"
        assert report.terminals > 0, "no path ended"
    if name == "mixed":
        assert RARE_PIPELINED <= reports[0].probes, RARE_PIPELINED - reports[0].probes
    elif name != "quick":
        assert RARE_PIPELINED <= reports[0].probes, RARE_PIPELINED - reports[0].probes
        assert {"queued_for_pages", "queued_for_adapters", "admitted_after_waiting"} <= reports[1].probes


def test_a_snapshot_copies_a_random_generator_by_its_state_once():
    # auto's tie-breaking draws (core/ahead.py): the twin draws what the
    # original would have, whatever the original draws after, and one
    # generator held twice is one twin.
    rng = random.Random(7)
    rng.random()
    twins = Cloner().copy([rng, rng])
    assert twins[0] is twins[1] and twins[0] is not rng
    want = [rng.random() for _ in range(5)]
    assert [twins[0].random() for _ in range(5)] == want


def test_a_snapshot_copies_a_counter_where_it_stands_once():
    # The engine's request ids and the clock's order: the twin counts on from
    # where the original stood, by its step, without copy.deepcopy (which
    # Python 3.14 no longer does for itertools objects).
    ids, steps = itertools.count(), itertools.count(5, 3)
    next(ids), next(ids), next(steps)
    twins = Cloner().copy([ids, steps, ids])
    assert twins[0] is twins[2] and twins[0] is not ids
    assert [next(ids), next(ids)] == [next(twins[0]), next(twins[0])] == [2, 3]
    assert [next(steps), next(twins[1])] == [8, 8]


def test_a_snapshot_runs_on_without_touching_its_original():
    # The fake schedules a copy's landing as a closure over its slot: a twin
    # must get its own, or its copy lands in the original's host buffer.
    bounds = BOUNDS["ci"]
    world = World.new(bounds, pipelined=True, probe=Probe())
    masks = (world.engine.register_mask(EVENS), world.engine.register_mask(ODDS))
    requests = bounds.contents(masks)
    world.backend.timing = type(world.backend.timing)(forward=1.0, copy=5.0)  # copies land late
    for request in (requests[0], requests[-1], requests[3]):
        world.submit(request)
    for _ in range(3):
        world.engine.tick()
    assert world.backend.clock._pending, "no copy in flight to test with"
    key = world.key()
    twin = Cloner().copy(world, [world.backend.model, world.backend.timing, *requests])
    twin.engine.run_until_idle()
    twin.check_state()
    assert world.key() == key
    world.engine.run_until_idle()
    assert [h.result for h in world.handles] == [h.result for h in twin.handles]
    assert world.backend.log == twin.backend.log


def test_a_snapshot_shares_only_what_cannot_change():
    bounds = BOUNDS["quick"]
    world = World.new(bounds, pipelined=True, probe=Probe())
    requests = bounds.contents((world.engine.register_mask(EVENS), world.engine.register_mask(ODDS)))
    world.submit(requests[0])
    world.engine.tick()
    twin = Cloner().copy(world)
    seq, twin_seq = world.engine.scheduler.seqs[0], twin.engine.scheduler.seqs[0]
    assert twin_seq is not seq and twin_seq.tokens is not seq.tokens and twin_seq.pages == seq.pages
    assert twin_seq.request is seq.request  # frozen: shared
    assert twin.watchers[0].engine is twin.engine and twin.handles[0]._engine is twin.engine
    assert twin.engine.scheduler.masks is twin.engine.masks  # the shared registry stays shared in the copy
    assert twin.key() == world.key()


def test_the_choice_search_refuses_an_outlook_that_changes_what_it_looks_at(monkeypatch):
    # The rule's look is timing only (I8): in "choice" mode the search checks
    # that the scheduler is as it was after each outlook.
    import bubblefree.core.engine as core_engine

    looked = core_engine.choose

    def planning(sched, rates, follow, bubble, forward, prefill_extra=0.0, arrivals=0):
        sched._next_step += 1  # as if it had planned a step
        return looked(sched, rates, follow, bubble, forward, prefill_extra, arrivals)

    monkeypatch.setattr(core_engine, "choose", planning)
    bounds = BOUNDS["quick"]
    world = World.new(bounds, pipelined="choice", probe=Probe())
    requests = bounds.contents((world.engine.register_mask(EVENS), world.engine.register_mask(ODDS)))
    world.submit(requests[0])
    with pytest.raises(InvariantViolation, match="I8: the auto rule's outlook changed"):
        world.engine.tick()


def test_the_choice_search_refuses_a_shortcut_that_is_not_the_rule(monkeypatch):
    # ``choose`` skips foreseeing the next step where the answer cannot
    # depend on it; the search compares it with the rule on the whole
    # outlook in every state. A shortcut that weighs every row that may end
    # as taken by the next step (never foreseeing it) is caught.
    import exhaustive_world

    def hasty(sched, rates, follow, bubble, forward, prefill_extra=0.0, arrivals=0):
        rows, zombies, may = ahead.outlook(sched, rates, max(follow, 1.0))
        return ahead.Choice(ahead.launch_ahead(rows, zombies, bubble, forward), may, rows, zombies, bubble)

    monkeypatch.setattr(exhaustive_world, "choose", hasty)
    report, = search_modes(BOUNDS["quick"], parallel=False, modes=("choice",))
    assert any("the auto rule's shortcut" in m for m, _ in report.violations), report.line()


def test_the_choice_search_refuses_zombies_named_on_the_wrong_side(monkeypatch):
    # The zombies ``choose`` names (what ``Engine.behind`` records) must give
    # its answer and lie on the answer's side of the whole outlook's: a
    # shortcut that names the outlook's zombies halved, whatever it
    # answered, is caught where ahead was the answer.
    import exhaustive_world

    def halved(sched, rates, follow, bubble, forward, prefill_extra=0.0, arrivals=0):
        got = ahead.choose(sched, rates, follow, bubble, forward, prefill_extra, arrivals)
        return got._replace(zombies=got.zombies / 2)

    monkeypatch.setattr(exhaustive_world, "choose", halved)
    report, = search_modes(BOUNDS["quick"], parallel=False, modes=("choice",))
    assert any("the auto rule's shortcut" in m for m, _ in report.violations), report.line()


def test_the_choice_search_refuses_a_bubble_without_the_next_prefill_s_launch(monkeypatch):
    # Behind, a caller's next request has its prefill launched with nothing
    # in flight: ``choose`` weighs that launch call's extra into the bubble
    # by the chance of a follower. A choice that leaves it out is caught
    # where the grid's prefill extra is not zero.
    import exhaustive_world

    def unweighed(sched, rates, follow, bubble, forward, prefill_extra=0.0, arrivals=0):
        return ahead.choose(sched, rates, follow, bubble, forward)

    monkeypatch.setattr(exhaustive_world, "choose", unweighed)
    report, = search_modes(BOUNDS["quick"], parallel=False, modes=("choice",))
    assert any("the auto rule's shortcut" in m for m, _ in report.violations), report.line()
