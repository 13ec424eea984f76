"""The auto mode's per-tick choice (core/ahead.py, core/ahead_measures.py): the rule, its
measurements on a fixed clock, the skills' ``may_end``, and an engine that
skips the zombie step where a row surely ends and launches ahead elsewhere,
with the tokens of blocking (I8)."""

from __future__ import annotations

import itertools

import attrs
import pytest

from bubblefree.core import Capacity, Engine, Request, Scheduler, StepKind, StepOutput
from bubblefree.core.ahead import Choice, choose, launch_ahead, may_end, outlook, weighed_bubble
from bubblefree.core.ahead_measures import (SAMPLE, WARMUP, WORTH, EndRates, Successors, Timings, Worth,
                                            bought)
from bubblefree.core.sequence import Sequence
from bubblefree.fake_backend import FakeBackend, FakeModel, Timing
from bubblefree.skills import Kind, SkillSet, demo_tokenizer
from bubblefree.skills.driver import MaskRecorder


# ------------------------------------------------------------------ the rule
def test_no_row_that_may_end_means_ahead_whatever_the_costs():
    assert launch_ahead(rows=4, zombies=0.0, bubble=0.0, forward=100.0)
    assert launch_ahead(rows=0, zombies=0.0, bubble=0.0, forward=100.0)


def test_no_rows_or_no_zombies_means_ahead_whatever_the_timings():
    # The rule's first clause on its own: no forward share is at stake, so
    # the measurements are not consulted, not even a bubble a clock that
    # stepped back made negative, nor a division by no rows.
    assert launch_ahead(rows=0, zombies=1.0, bubble=0.0, forward=1.0)
    assert launch_ahead(rows=2, zombies=0.0, bubble=-1.0, forward=1.0)


def test_rows_that_surely_end_block_unless_the_bubble_covers_a_forward():
    assert not launch_ahead(rows=3, zombies=3.0, bubble=0.9, forward=1.0)
    assert launch_ahead(rows=3, zombies=3.0, bubble=1.0, forward=1.0)


def test_the_zombies_cost_their_share_of_the_forward():
    # One row in four likely to end: a quarter of a 2.0 forward against the bubble.
    assert launch_ahead(rows=4, zombies=1.0, bubble=0.5, forward=2.0)
    assert not launch_ahead(rows=4, zombies=1.0, bubble=0.49, forward=2.0)
    assert not launch_ahead(rows=1, zombies=5.0, bubble=0.99, forward=1.0)  # never more than all rows


def test_successors_learn_the_share_of_ends_answered_before_the_next_launch():
    follow = Successors()
    assert follow.rate == 0.5
    follow.launching()  # no end before this launch: nothing to learn from
    assert follow.rate == 0.5
    for _ in range(30):  # two ends, one next request, before each launch
        follow.ends, follow.submitted = 2, 1
        follow.launching()
    assert follow.rate == pytest.approx(0.5, abs=1e-9) and follow.ends == follow.submitted == 0
    for _ in range(30):  # more requests than ends: at most one per end counts
        follow.ends, follow.submitted = 1, 3
        follow.launching()
    assert follow.rate == pytest.approx(1.0, abs=1e-2)
    for _ in range(30):
        follow.ends = 4
        follow.launching()
    assert follow.rate == pytest.approx(0.0, abs=1e-2)


def test_end_rates_start_at_a_half_and_learn_per_skill():
    rates = EndRates()
    assert rates.rate("point") == 0.5
    for _ in range(8):
        rates.record(None, False)
    rates.record("point", True)
    assert rates.rate(None) == 0.1 and rates.rate("point") == 2 / 3


def test_a_position_s_end_rate_starts_at_its_skill_s_and_learns_apart():
    rates = EndRates()
    for _ in range(4):  # an object list: never empty, its last object's token always ends it
        rates.record("detect", False, 0)
        rates.record("detect", True, 2)
    assert rates.rate("detect") == 0.5  # pooled, the two chances look alike
    assert rates.rate("detect", 0) == pytest.approx((0 + 2 * 0.5) / (4 + 2))
    assert rates.rate("detect", 2) == pytest.approx((4 + 2 * 0.5) / (4 + 2))
    assert rates.rate("detect", 5) == rates.rate("detect")  # a position not seen yet: the skill's rate
    assert rates.rate("point", 0) == 0.5  # a skill not seen yet: the prior


# --------------------------------------------------------- measurements
@attrs.define
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def test_timings_measure_bubble_and_forward_on_a_fixed_clock():
    clock = FakeClock()
    t = Timings(clock)
    assert t.bubble == 0.0 and t.forward is None
    clock.now = 1.0
    t.launched(0, started=0.5)  # planning and the launch call: 0.5
    clock.now = 5.0
    arrived = t.arrived(0)  # behind: device time from its launch, 4.0
    clock.now = 5.25
    t.committed(arrived)  # commit bookkeeping: 0.25
    assert (t.launch_host, t.commit_host, t.forward, t.bubble) == (0.5, 0.25, 4.0, 0.75)
    # Ahead: step 1 launched before step 0 arrived; its device time is the
    # gap between the two arrivals.
    t.launched(1, started=4.0)  # launched at 5.25: after the arrival, so behind again
    clock.now = 8.25
    t.arrived(1)
    assert t.forward == pytest.approx(4.0 + 0.2 * (3.0 - 4.0))
    clock.now = 9.0
    t.launched(2, started=9.0)
    t.launched(3, started=9.0)
    clock.now = 11.0
    t.arrived(2)
    clock.now = 12.0
    t.arrived(3)  # launched at 9, but the device was busy with step 2 until 11
    assert t.forward == pytest.approx(3.8 + 0.2 * (2.0 - 3.8) + 0.2 * (1.0 - (3.8 + 0.2 * (2.0 - 3.8))))
    t.launched(4, started=12.0)
    t.forget()
    assert t.arrived(4) == 12.0 and t.forward == pytest.approx(
        3.8 + 0.2 * (2.0 - 3.8) + 0.2 * (1.0 - (3.8 + 0.2 * (2.0 - 3.8))))  # forgotten: no sample


def test_a_prefills_device_and_launch_times_stay_out_of_the_decode_figures():
    """The rule weighs a decode step's zombie rows against a decode launch's
    bubble: an image prefill ten times a decode step (moondream2's) once
    made the mean forward so long that auto launched behind where ahead
    won (point at 8 streams on images: 0.94x pipelined)."""
    clock = FakeClock()
    t = Timings(clock)
    clock.now = 2.0
    t.launched(0, started=0.0, kind=StepKind.IMAGE_PREFILL)  # a 2-s launch call
    t.launched(1, started=2.0)  # a decode step: its launch call takes nothing
    clock.now = 12.0
    t.arrived(0)  # the prefill: 10 s of device time
    clock.now = 13.0
    t.arrived(1)  # the decode step, right behind it: 1 s
    t.committed(12.5)
    assert t.forwards == {StepKind.IMAGE_PREFILL: 10.0, StepKind.DECODE: 1.0}
    assert t.forward == 1.0 and t.launch_host == 0.0 and t.bubble == 0.5
    assert t.launch_hosts[StepKind.IMAGE_PREFILL] == 2.0
    # One row of four surely ending: ahead, since the bubble covers a decode
    # step's share (0.25); a mean over both kinds (5.5 s) would say behind.
    assert launch_ahead(4, 1.0, t.bubble, t.forward)
    assert not launch_ahead(4, 1.0, t.bubble, (10.0 + 1.0) / 2)


def test_another_kind_s_costlier_launch_call_stays_out_of_a_decode_sample():
    """Between two decode arrivals the host launched an image prefill, its
    call 1.5 s where a decode launch takes 0.25: the later arrival was seen
    1.25 s late by a host that was busy, not by the device. Counted in,
    the forward rose and leaned the rule behind where pipelined won."""
    clock = FakeClock()
    t = Timings(clock)
    clock.now = 0.25
    t.launched(0, started=0.0)  # decode, 0.25 s launch call
    clock.now = 1.0
    t.arrived(0)  # sample 0.75
    clock.now = 1.25
    t.launched(1, started=1.0)  # decode, launched behind
    clock.now = 2.75
    t.launched(2, started=1.25, kind=StepKind.IMAGE_PREFILL)  # a 1.5-s launch call
    t.arrived(1)  # at 2.75: 1.5 s after its launch, 1.25 of it the prefill's call beyond a decode launch's
    assert t.forward == pytest.approx(0.75 + 0.2 * (0.25 - 0.75))
    clock.now = 3.0
    t.launched(3, started=2.75)  # no other kind's call in its gap: the whole gap is the sample
    clock.now = 4.0
    t.arrived(3)
    assert t.forward == pytest.approx(0.65 + 0.2 * (1.0 - 0.65))


def test_a_forgotten_step_takes_no_sample_when_it_arrives():
    clock = FakeClock()
    t = Timings(clock)
    t.launched(0, started=0.0)
    t.launched(1, started=0.0)
    t.forget(0)  # failed: only step 0 is forgotten
    clock.now = 3.0
    t.arrived(0)
    assert t.forward is None
    clock.now = 5.0
    t.arrived(1)
    assert t.forward == 2.0  # from step 0's arrival: forgotten, it still marks when the device was free


# ------------------------------------------------------------- may_end
TOK = demo_tokenizer()
MASKS = MaskRecorder()
SKILLS = SkillSet(TOK, MASKS.register).compile_all()
CODEC = SKILLS.codec


def test_an_object_list_may_end_only_at_slot_0_or_its_last_object():
    state = SKILLS.request("detect", object="dog", max_objects=2).decode_state()
    box = (CODEC.encode(Kind.X, .5), CODEC.encode(Kind.Y, .5), CODEC.encode(Kind.SIZE, .1),
           CODEC.encode(Kind.SIZE, .1))
    seen = []
    for token in box + box:
        seen.append(state.may_end())
        state.advance(token)
    # slot 0 (EOS allowed); then the second box's last slot ends the list (max_objects).
    assert seen == [True, False, False, False, True, False, False, True]
    assert state.done


def test_a_point_list_cut_by_its_budget_may_end_at_the_last_point():
    state = SKILLS.request("point", object="cat", max_tokens=3).decode_state()  # one point fits
    x, y = CODEC.encode(Kind.X, .5), CODEC.encode(Kind.Y, .5)
    assert state.may_end()
    state.advance(x)
    assert state.may_end()  # y completes the only point that fits
    assert state.advance(y)


def test_text_skills_may_always_end():
    for name, args in (("query", {"question": "what"}), ("caption", {"length": "short"})):
        assert SKILLS.request(name, **args).decode_state().may_end()


@attrs.define
class Never:
    def mask_id(self):
        return None

    def advance(self, token, value):
        return False

    def may_end(self):
        raise RuntimeError("skill bug")


def test_may_end_reads_stop_ids_through_the_mask_then_the_skill():
    masks = {7: frozenset({1, 2}), 8: frozenset({0, 1})}
    plain = Sequence(0, Request(prompt=(1,), max_tokens=4, stop_ids={0}))
    assert may_end(plain, None, masks) and may_end(plain, 8, masks)
    assert not may_end(plain, 7, masks)  # its mask excludes the stop id, and no skill
    assert not may_end(Sequence(1, Request(prompt=(1,), max_tokens=4)), None, masks)
    skilled = Sequence(2, Request(prompt=(1,), max_tokens=4, stop_ids={0}))
    skilled.state = Never()
    assert may_end(skilled, 7, masks)  # a raising may_end counts as True, and only that


def test_a_mask_the_registry_does_not_know_may_end():
    # Timing only: an id missing from ``masks`` is no reason to raise, and
    # nothing says its stop id is excluded.
    plain = Sequence(0, Request(prompt=(1,), max_tokens=4, stop_ids={0}))
    assert may_end(plain, 9, {7: frozenset({1, 2})})


# ------------------------------------------------------------- outlook
CAP = Capacity(num_pages=16, page_size=4, max_rows=4, max_seqs=4, max_prefill_tokens=8, max_context=16)
ONE_ROW = attrs.evolve(CAP, max_rows=1)
ONE_SEQ = attrs.evolve(CAP, max_seqs=1)
NO_STOP = 7  # the mask that leaves out the stop id 0


@attrs.define
class Quiet:
    """A skill state that masks the stop id out and says it cannot end."""

    def mask_id(self):
        return NO_STOP

    def advance(self, token, value):
        return False

    def may_end(self):
        return False


def scheduler(cap, *requests):
    sched = Scheduler(cap, masks={NO_STOP: frozenset({1, 2, 3})})
    for i, req in enumerate(requests):
        sched.add(Sequence(i, req))
    return sched


def launch(sched):
    """Plan, launch and finalize the next step (the engine's launch and finalize)."""
    slot, plan = sched.plan_launch()
    sched.launched(slot, plan)
    step, _ = sched.plan_finalize()
    sched.finalized(step)
    return plan


def commit(sched, *tokens):
    step = sched.next_commit()
    sched.commit(step, StepOutput(step.step_id, tokens), None)


def one_may_end():
    """Two rows decoding: row 0 may end at the pending decode u (stop id 0),
    row 1 cannot."""
    sched = scheduler(CAP, Request(prompt=(1, 2), max_tokens=8, stop_ids=frozenset({0})),
                      Request(prompt=(1, 2), max_tokens=8))
    launch(sched)  # both prefilled
    commit(sched, 1, 1)
    launch(sched)  # u
    return sched


def plain(**kw):
    return Request(prompt=(1, 2), max_tokens=8, stop_ids={0}, **kw)


def test_outlook_is_empty_with_no_step_in_flight():
    sched = scheduler(CAP, plain())
    launch(sched)
    commit(sched, 1)  # running, a decode waits, but nothing is uncommitted
    assert not sched.inflight and sched.preview()[0] is StepKind.DECODE
    assert outlook(sched, EndRates()) == (0, 0.0, {})


def test_outlook_is_empty_with_no_free_slot():
    sched = scheduler(CAP, plain())
    launch(sched)
    launch(sched)  # both slots busy: nothing launches this tick
    assert sched.preview()[0] is StepKind.DECODE
    assert outlook(sched, EndRates()) == (0, 0.0, {})


def test_when_a_prefill_is_next_a_row_that_may_end_weighs_as_its_callers_follow():
    sched = scheduler(ONE_ROW, plain(), plain())
    launch(sched)  # prefill of 0; 1 admitted, waiting
    launch(sched)  # the decode of 0: now the prefill's turn
    commit(sched, 1)
    assert sched.inflight and sched.preview()[0] is StepKind.PREFILL
    # Row 0 may end at the pending decode; the prefill launched ahead does
    # not take it, so it is no zombie: it costs only a next request that
    # would miss the prefill, as often as callers send one.
    assert outlook(sched, EndRates()) == (1, 0.0, {(None, 1): [0]})  # (skill, position): seq ids
    assert outlook(sched, EndRates(), follow=0.5) == (1, 0.25, {(None, 1): [0]})


def test_preview_alternates_like_the_launch_it_foresees():
    sched = scheduler(ONE_ROW, plain(), plain())
    launch(sched)  # prefill of 0: 0 may decode, 1 may prefill; the last step was a prefill
    foreseen = sched.preview()
    _, plan = sched.plan_launch()
    assert foreseen == (plan.kind, [sched.seqs[r.seq_id] for r in plan.rows])
    assert plan.kind is StepKind.DECODE and [r.seq_id for r in plan.rows] == [0]


def test_outlook_counts_only_the_rows_the_pending_mask_lets_end():
    sched = scheduler(CAP, plain(), plain(decode_state=Quiet))
    launch(sched)  # both prefilled; row 1 masked to {1, 2, 3} and cannot end
    assert outlook(sched, EndRates()) == (2, 0.5, {(None, 0): [0]})


def test_outlook_weighs_each_row_by_its_skills_rate():
    rates = EndRates()
    rates.record(None, False)  # plain text: 1/3
    rates.record("point", True)  # points: 2/3
    sched = scheduler(CAP, plain(), plain(skill="point"))
    launch(sched)
    rows, zombies, may = outlook(sched, rates)
    assert (rows, may) == (2, {(None, 0): [0], ("point", 0): [1]}) and zombies == pytest.approx(1.0)
    assert rates.rate(None) != rates.rate("point")


# ----------------------------------------------------------- the engine
@attrs.define
class Three:
    """Done after three tokens, and says so: ``may_end`` only at the third."""

    at: int = 0

    def mask_id(self):
        return None

    def advance(self, token, value):
        self.at += 1
        return self.at == 3

    def may_end(self):
        return self.at == 2


@attrs.define(eq=False)
class Recording(Engine):
    """Keeps each auto choice: True ahead, False behind; and the whole
    outlook's rows and ``z`` at each (taken before the choice: it changes
    nothing)."""

    choices: list = attrs.Factory(list)
    outlooks: list = attrs.Factory(list)

    def _ahead(self) -> bool:
        self.outlooks.append(outlook(self.scheduler, self.end_rates, self.successors.rate)[:2])
        self.choices.append(super()._ahead())
        return self.choices[-1]


def run(pipelined, requests):
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0))
    engine = Recording(backend, pipelined=pipelined, clock=lambda: backend.clock.host)
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle(max_ticks=200)
    launches = sum(e[0] == "launch" for e in engine.trace)
    return [h.result for h in handles], launches, engine


def test_auto_skips_the_zombie_step_of_a_sure_end_and_keeps_the_tokens():
    reqs = [Request(prompt=(3, 5), max_tokens=8, decode_state=Three) for _ in range(2)]
    blocking, block_launches, _ = run(False, reqs)
    ahead, ahead_launches, _ = run(True, reqs)
    auto, auto_launches, engine = run("auto", reqs)
    assert auto == blocking == ahead  # I8: timing only
    assert block_launches == 3  # one prefill, two decodes
    assert ahead_launches == 4  # the zombie decode after the third token
    assert auto_launches == 3
    assert False in engine.choices and engine.end_rates.rate(None) > 0.5


@pytest.mark.parametrize("mode", [True, False, "auto"])
def test_auto_counts_the_host_clock_it_spends_choosing_and_the_other_modes_none(mode):
    """``Engine.choose_host``, the rule's own host time (``bench.speed``
    reports it per run): on a clock that moves one unit a reading, exactly
    one unit a choice, as the rule itself reads no clock; the modes that
    never choose spend none."""
    readings = itertools.count()
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0))
    engine = Engine(backend, pipelined=mode, clock=lambda: float(next(readings)))
    for _ in range(3):
        engine.submit(Request(prompt=(3, 5), max_tokens=8, decode_state=Three))
    engine.run_until_idle(max_ticks=200)
    choices = engine.ahead_ticks + engine.behind_ticks
    assert engine.choose_host == choices
    assert (choices > 0) == (mode == "auto")


def test_auto_launches_ahead_once_text_rarely_ends():
    reqs = [Request(prompt=(0, 5), max_tokens=40, stop_ids={0})]  # EOS never comes first here
    blocking, _, _ = run(False, reqs)
    auto, _, engine = run("auto", reqs)
    assert auto == blocking
    # The prior (one end in two chances) blocks the first decodes; each
    # step that did not end teaches the rate down until the bubble wins.
    # The last token ends the request for sure: a caller's next request
    # (the prior share of ½; none has been measured) would miss a launch
    # ahead, so the last step commits at once.
    assert False in engine.choices[:5] and all(engine.choices[-20:-1]) and engine.choices[-1] is False
    assert engine.end_rates.rate(None) < 0.1
    assert engine.timings.forward == pytest.approx(2.0, rel=0.1)


def test_auto_commits_at_every_tick_on_a_backend_whose_launch_computes_the_step():
    """``Capacity.asynchronous`` False (torch on a CPU): the launch call is
    the forward, so launching ahead hides nothing. The text that made auto
    go ahead above takes blocking's order at every tick, and its launches,
    with the same tokens."""
    reqs = [Request(prompt=(0, 5), max_tokens=40, stop_ids={0})]
    blocking, block_launches, _ = run(False, reqs)
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0))
    backend._capacity = attrs.evolve(backend.capacity, asynchronous=False)
    engine = Recording(backend, pipelined="auto", clock=lambda: backend.clock.host)
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_idle(max_ticks=200)
    assert [h.result for h in handles] == blocking
    assert sum(e[0] == "launch" for e in engine.trace) == block_launches
    assert engine.choices and not any(engine.choices)
    assert (engine.ahead_ticks, engine.behind_ticks) == (0, len(engine.choices))
    assert not engine.behind  # no rule was weighed: nothing to explain


def test_the_engine_counts_auto_s_choices_and_nothing_in_the_other_modes():
    reqs = [Request(prompt=(0, 5), max_tokens=40, stop_ids={0})]
    _, _, engine = run("auto", reqs)
    assert engine.ahead_ticks == engine.choices.count(True) > 0
    assert engine.behind_ticks == engine.choices.count(False) > 0
    for mode in (True, False):
        _, _, other = run(mode, reqs)
        assert (other.ahead_ticks, other.behind_ticks, other.choices) == (0, 0, [])


def test_each_behind_tick_keeps_the_inputs_that_chose_it():
    """``Engine.behind``: the rule's inputs at the behind ticks, newest
    kept, each one the rule answers behind for; none in the other modes."""
    from bubblefree.core.engine import BEHIND_KEPT
    reqs = [Request(prompt=(3, 5), max_tokens=8, decode_state=Three) for _ in range(3)]
    reqs += [Request(prompt=(0, 5), max_tokens=40, stop_ids={0})]
    _, _, engine = run("auto", reqs)
    assert len(engine.behind) == engine.behind_ticks == engine.choices.count(False) > 0
    whole = [o for o, ahead in zip(engine.outlooks, engine.choices) if not ahead]
    for b, (rows, zombies) in zip(engine.behind, whole, strict=True):
        assert b.rows == rows > 0 and 0 < b.zombies <= zombies  # the bound that decided, or z
        assert b.forward == pytest.approx(2.0, rel=0.5)
        assert not launch_ahead(b.rows, b.zombies, b.bubble, b.forward)
    for mode in (True, False):
        assert not run(mode, reqs)[2].behind
    engine.behind.extend([engine.behind[0]] * (2 * BEHIND_KEPT))
    assert len(engine.behind) == BEHIND_KEPT  # a long-lived server keeps the newest only


def test_the_engine_times_each_step_kind_apart():
    _, _, engine = run("auto", [Request(prompt=(0, 5), max_tokens=6, stop_ids={0})])
    assert set(engine.timings.forwards) == set(engine.timings.launch_hosts) == \
        {StepKind.PREFILL, StepKind.DECODE}
    assert engine.timings.forward == engine.timings.forwards[StepKind.DECODE]


def test_auto_launches_ahead_before_any_forward_is_measured():
    # The first decode may end (a stop id, the prior's rate of a half), but no
    # step has arrived yet: the rule sees no device time to lose, so ahead.
    _, _, engine = run("auto", [Request(prompt=(0, 5), max_tokens=3, stop_ids={0})])
    order = [e[:2] for e in engine.trace if e[0] in ("launch", "commit")]
    assert order[:3] == [("launch", 0), ("launch", 1), ("commit", 0)]
    assert engine.choices[1] is True


def test_the_mode_is_true_false_or_auto():
    engine = Engine(FakeBackend(zero_cost=True))
    engine.pipelined = "auto"
    engine.pipelined = False
    for bad in ("yes", 1, None, "Auto"):
        with pytest.raises(ValueError, match="pipelined"):
            engine.pipelined = bad
        with pytest.raises(ValueError, match="pipelined"):
            Engine(FakeBackend(zero_cost=True), pipelined=bad)
    assert engine.pipelined is False


@attrs.define
class EndsAt:
    """Done after ``n`` tokens, and says so: ``may_end`` only before the last."""

    n: int
    at: int = 0

    def mask_id(self):
        return None

    def advance(self, token, value):
        self.at += 1
        return self.at == self.n

    def may_end(self):
        return self.at == self.n - 1


def ends_at(n):
    return Request(prompt=(3, 5), max_tokens=8, decode_state=lambda: EndsAt(n))


def closed_loop(pipelined, each=6, request=ends_at):
    """Two callers, each answering its request's end with its next request
    from a listener, ``each`` requests apiece: one caller's requests end at their
    third token, the other's at their fifth (``request(n)``), so ends come
    one at a time while the other row decodes. With a 2.0 forward and a
    bubble of 0.1 the rule chooses behind where a row may end."""
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0))
    engine = Recording(backend, pipelined=pipelined, clock=lambda: backend.clock.host)
    handles = []

    def submit(n, left):
        handles.append(engine.submit(request(n)))
        handles[-1].listeners.append(lambda h, token: token is None and left > 1 and submit(n, left - 1))

    submit(3, each)
    submit(5, each)
    engine.run_until_idle(max_ticks=500)
    prefills = [e[4] for e in engine.trace if e[0] == "launch" and e[2] == StepKind.PREFILL.value]
    return sorted(h.result.tokens for h in handles), prefills, backend.clock.host, engine


def test_behind_hands_the_ends_to_the_caller_before_the_next_launch_as_blocking_does():
    # A caller's next request, sent from the end's listener, is in the very
    # next launch, as in blocking: ends come one at a time here, and each
    # replacement's prefill is the step right after its predecessor's last.
    blocking, block_prefills, block_time, _ = closed_loop(False)
    auto, auto_prefills, auto_time, engine = closed_loop("auto")
    assert auto == blocking and False in engine.choices
    assert auto_prefills == block_prefills
    assert auto_time <= block_time


def test_the_engine_learns_whether_its_callers_answer_an_end_with_a_request():
    # Callers that send their next request from the end's listener: each
    # end before a launch is answered but their last ones (the running mean
    # keeps the recent past). Callers that send nothing more: none.
    _, _, _, looping = closed_loop("auto")
    assert looping.successors.rate > 0.75
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0))
    engine = Engine(backend, pipelined="auto", clock=lambda: backend.clock.host)
    for n in range(2, 14):  # one end a step
        engine.submit(Request(prompt=(3, 5), max_tokens=16, decode_state=lambda n=n: EndsAt(n)))
    engine.run_until_idle(max_ticks=200)
    assert engine.successors.rate < 0.1


def test_a_prefill_next_goes_ahead_of_a_likely_end_only_when_no_caller_would_answer_it():
    # Row 0 surely ends at its pending decode (rate 1); the next step is the
    # prefill of row 1, which takes no zombie. Launched ahead, it leaves out
    # the request row 0's caller would send: that costs a row's share of a
    # forward (2.0 / 1) against a bubble of 0.5, as often as callers answer.
    sched = scheduler(ONE_ROW, plain(), plain())
    launch(sched)
    launch(sched)
    commit(sched, 1)
    rates = EndRates(counts={None: (98, 98)})  # plain text ends where it may
    for follow, ahead in ((0.0, True), (0.2, True), (0.3, False), (1.0, False)):
        rows, zombies, _ = outlook(sched, rates, follow)
        assert launch_ahead(rows, zombies, bubble=0.5, forward=2.0) is ahead, follow


def test_a_prefill_launch_costlier_than_a_decode_s_is_measured_over_every_prefill_kind():
    clock = FakeClock()
    t = Timings(clock)
    assert t.prefill_extra == 0.0  # nothing measured yet
    clock.now = 3.0
    t.launched(0, started=0.0, kind=StepKind.IMAGE_PREFILL)  # 3.0
    assert t.prefill_extra == 0.0  # no decode launch to compare with
    clock.now = 4.0
    t.launched(1, started=3.5)  # a decode launch: 0.5
    clock.now = 6.0
    t.launched(2, started=5.0, kind=StepKind.PREFILL)  # a text prefill: 1.0
    assert t.prefill_launch == pytest.approx(3.0 + 0.2 * (1.0 - 3.0))  # one mean over both kinds
    assert t.prefill_extra == pytest.approx(2.6 - 0.5)
    clock.now = 16.0
    t.launched(3, started=-4.0)  # a decode launch of 20: its mean, 4.4, passes the prefills' 2.6
    assert t.launch_host == pytest.approx(4.4) and t.prefill_extra == 0.0  # never below nothing


def test_the_bubble_weighs_the_next_prefill_s_launch_by_a_caller_s_chance_and_the_live_rows():
    assert weighed_bubble(0.5, 2.0, follow=0.0, ends=3.0, rows=8) == 0.5  # no caller answers: a decode is next
    assert weighed_bubble(0.5, 2.0, follow=0.25, ends=2.0, rows=8) == 0.5 + (0.5 * 7 / 8) * 2.0 * 6 / 8
    assert weighed_bubble(0.5, 2.0, follow=1.0, ends=0.0, rows=8) == 0.5  # no end expected
    assert weighed_bubble(0.5, 2.0, follow=1.0, ends=4.0, rows=8) == 0.5 + 2.0 * 4 / 8  # at most one call
    assert weighed_bubble(0.5, 2.0, follow=1.0, ends=8.0, rows=8) == 0.5  # v would hold zombies only
    assert weighed_bubble(0.5, 2.0, follow=1.0, ends=1.0, rows=1) == 0.5  # one stream: its row surely ends
    assert weighed_bubble(0.5, 2.0, follow=1.0, ends=1.0, rows=0) == 0.5
    # Two rows: row 0 may end at its pending decode (its rate 0.5 at each
    # token), row 1 is plain and runs on. With an image prefill's launch 4.0
    # over a decode's and every caller answering: 0.3 + (0.5 x 1 / 2) x 4.0
    # x 1.5 / 2.
    sched, rates = one_may_end(), EndRates()
    rows, zombies, _ = outlook(sched, rates, 1.0)
    assert (rows, zombies) == (2, 0.5)
    assert not choose(sched, rates, 1.0, 0.3, 2.0).ahead  # 0.3 < 2.0 x 0.5 / 2
    got = choose(sched, rates, 1.0, 0.3, 2.0, prefill_extra=4.0)
    assert got.bubble == pytest.approx(0.3 + 0.25 * 4.0 * 1.5 / 2) and got.ahead
    assert choose(sched, rates, 0.0, 0.3, 2.0, prefill_extra=4.0).bubble == 0.3  # nobody follows


def test_requests_handed_over_and_not_yet_admitted_make_a_prefill_next():
    # v is the prefill of requests the scheduler has queued or the serving
    # loop still holds (``arrivals``), as ``choose_step`` alternates: u's
    # rows that may end are then in no step v runs, and weigh the callers'
    # share alone; while a row slot is free for them and the last launch
    # was not a prefill.
    sched, rates = one_may_end(), EndRates()
    assert outlook(sched, rates, 0.0) == (2, 0.5, {(None, 1): [0]})  # v a decode: row 0 is in it
    assert outlook(sched, rates, 0.0, arrivals=1) == (2, 0.0, {(None, 1): [0]})  # v a prefill
    assert outlook(sched, rates, 0.5, arrivals=3) == (2, 0.25, {(None, 1): [0]})
    for share in (0.0, 0.3, 1.0):  # the shortcut agrees with the whole outlook
        rows, zombies, may = outlook(sched, rates, share, arrivals=1)
        got = choose(sched, rates, share, 0.4, 2.0, arrivals=1)
        assert got[:3] == (launch_ahead(rows, zombies, 0.4, 2.0), may, rows)
    assert not choose(sched, rates, 0.0, 0.4, 2.0).ahead  # 0.4 < 2.0 x 0.5 / 2
    assert choose(sched, rates, 0.0, 0.4, 2.0, arrivals=1).ahead  # no zombie: v is a prefill
    sched.add(Sequence(2, Request(prompt=(3, 4), max_tokens=8)))  # queued, a row slot free
    assert outlook(sched, rates, 0.0) == (2, 0.0, {(None, 1): [0]})
    full = scheduler(ONE_SEQ, Request(prompt=(1, 2), max_tokens=8, stop_ids=frozenset({0})))
    launch(full)
    commit(full, 1)
    launch(full)
    assert outlook(full, rates, 0.0, arrivals=2) == (1, 0.5, {(None, 1): [0]})  # no slot: it decodes on
    after = scheduler(CAP, Request(prompt=(1, 2), max_tokens=8, stop_ids=frozenset({0})))
    launch(after)  # u is a prefill: the rows it started decode next
    assert outlook(after, rates, 0.0, arrivals=2) == (1, 0.5, {(None, 0): [0]})


def test_choose_foresees_the_next_step_only_where_the_answer_depends_on_it(monkeypatch):
    # Row 0 ends at its pending decode (rate 0.99); a prefill is next. z is
    # 0.99 if v took row 0, 0.99 x the callers' share if not, and a bubble
    # of a quarter of the forward lies between them at shares of 0 and 0.2:
    # v must be foreseen. With a bubble of a whole forward, or of none, or
    # a share of 0.5 or 1 (both weights then past the line), both give the
    # same answer and ``preview`` is never asked.
    sched = scheduler(ONE_ROW, plain(), plain())
    launch(sched)
    launch(sched)
    commit(sched, 1)
    rates = EndRates(counts={None: (98, 98)})
    asked = []
    real = Scheduler.preview
    monkeypatch.setattr(Scheduler, "preview", lambda self: asked.append(1) or real(self))
    for bubble, forward, share, foresees in ((0.5, 2.0, 0.0, True), (0.5, 2.0, 0.2, True),
                                             (0.5, 2.0, 0.5, False), (0.5, 2.0, 1.0, False),
                                             (2.0, 2.0, 0.0, False), (0.0, 2.0, 1.0, False)):
        asked.clear()
        rows, zombies, may = outlook(sched, rates, share)
        got = choose(sched, rates, share, bubble, forward)
        assert got[:3] == (launch_ahead(rows, zombies, bubble, forward), may, rows)
        assert got.zombies >= zombies if got.ahead else got.zombies <= zombies
        asked.clear()
        choose(sched, rates, share, bubble, forward)
        assert bool(asked) is foresees, (bubble, forward, share)


def test_a_row_at_its_last_token_weighs_its_callers_share_and_teaches_no_rate():
    sched = scheduler(CAP, Request(prompt=(1, 2), max_tokens=2), plain())
    launch(sched)  # both prefilled
    commit(sched, 1, 1)
    launch(sched)  # row 0's second token is its last; row 1 (stop id 0) may end
    rows, zombies, may = outlook(sched, EndRates(), follow=0.5)
    # Row 0: certain, weighs 0.5; row 1: rate ½, taken by the next decode: 0.5.
    assert (rows, zombies, may) == (2, 1.0, {(None, 1): [1]})


def test_closed_loops_that_end_by_length_go_behind_at_each_last_token():
    # Plain requests (no stop id, no skill) end only by their length cap;
    # callers answer each end at once. Launching ahead of a last token
    # would leave the next request out of the next step.
    def plain_of(n):
        return Request(prompt=(3, 5), max_tokens=n)

    runs = {mode: closed_loop(mode, request=plain_of) for mode in (True, False, "auto")}
    assert runs[True][0] == runs[False][0] == runs["auto"][0]
    assert runs["auto"][2] <= min(runs[True][2], runs[False][2])


@attrs.define
class EmptyOrThree(Three):
    """Done after three tokens, like ``Three``, but says it may end at its
    first too, as an object list that could be empty does, and never does
    there."""

    def may_end(self):
        return self.at in (0, 2)


def test_auto_learns_at_which_token_a_skill_ends_and_goes_ahead_where_it_does_not():
    # One request at a time, as one stream's caller sends them. Pooled,
    # the skill's chances end half the time, which blocks both; apart, the
    # first token's rate falls and the last's rises.
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0))
    engine = Recording(backend, pipelined="auto", clock=lambda: backend.clock.host)
    per_request = []
    for _ in range(30):  # the bubble is 1/20 of a forward here: ahead once the first token's rate is below
        handle = engine.submit(Request(prompt=(3, 5), max_tokens=8, decode_state=EmptyOrThree, skill="detect"))
        before = len(engine.choices)
        engine.run_until_idle(max_ticks=50)
        assert handle.result.tokens == (26, 5, 0)  # I8: what blocking commits (the fake model's tokens)
        per_request.append(engine.choices[before:])
    rates = engine.end_rates
    assert rates.rate("detect") == pytest.approx(0.5, abs=0.05)  # pooled: half the chances end
    assert rates.rate("detect", 0) < 0.05 and rates.rate("detect", 2) > 0.95
    assert engine.timings.bubble < 0.05 * engine.timings.forward
    # Each request: its prefill's token (may end: ahead once learned), its
    # second (cannot end: ahead), its third (ends: behind, no zombie).
    assert per_request[-3:] == [[True, True, False]] * 3


# ------------------------------------------------------ the choice's own cost
def test_what_a_choice_buys_is_the_zombie_share_it_avoided_less_the_bubble_it_left():
    assert bought(Choice(True, {}, rows=4, zombies=4.0, bubble=0.0), forward=2.0) == 0.0  # ahead: nothing
    assert bought(Choice(False, {}, rows=4, zombies=1.0, bubble=0.3), forward=2.0) == pytest.approx(0.2)
    assert bought(Choice(False, {}, rows=2, zombies=5.0, bubble=0.5), forward=2.0) == pytest.approx(1.5)  # at most all rows
    assert bought(Choice(False, {}, rows=0), forward=2.0) == 0.0


def test_choices_are_weighed_each_tick_until_they_have_bought_under_an_eighth_of_their_cost():
    worth = Worth()
    for _ in range(WARMUP - 1):  # costly and buying nothing, but too few to judge by
        assert worth.weigh()
        worth.record(1.0, 0.0)
    worth.record(1.0, 1.0 / WORTH * WARMUP)  # the plain mean so far: exactly an eighth of the cost
    assert worth.gain == pytest.approx(1.0 / WORTH) and all(worth.weigh() for _ in range(200))
    for _ in range(200):  # buying nothing: a tick is weighed with chance SAMPLE
        worth.record(1.0, 0.0)
    draws = [worth.weigh() for _ in range(4000)]
    assert abs(sum(draws) / len(draws) - SAMPLE) < 0.02


def test_a_free_choice_is_always_weighed():
    worth = Worth()
    for _ in range(10 * WARMUP):  # a clock that does not move while choosing (the simulated GPU's)
        worth.record(0.0, 0.0)
    assert all(worth.weigh() for _ in range(500))


class Always(Worth):
    def weigh(self):
        return True


def charged(pipelined, requests, cost, worth=None, forward=1.0, host=0.4):
    """``run`` with the rule's own host work charged on the host clock:
    ``cost`` a choice, spent where the Engine times its choice (its
    ``arrivals`` call, inside); ``host`` each launch and each finalize."""
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=forward, sampling=0.0, copy=0.0, launch_cost=host,
                                                             finalize_cost=host))
    engine = Recording(backend, pipelined=pipelined, clock=lambda: backend.clock.host)
    engine.arrivals = lambda: backend.clock.spend(cost) and 0
    if worth is not None:
        engine.worth = worth
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle(max_ticks=2000)
    return [h.result for h in handles], backend.clock.host, engine


def test_where_choosing_buys_nothing_most_ticks_go_ahead_unweighed_with_blocking_s_tokens():
    # Text that rarely ends, the rule's host work 0.5 against a forward of
    # 1.0 and a host tick of 0.8: host-bound, its choices buy nothing once
    # the end rate is learned, so after the warm-up most ticks go ahead
    # unweighed, each 0.3 sooner than weighing (the host's 1.3 against the
    # device's 1.0).
    reqs = [Request(prompt=(0, 5), max_tokens=250, stop_ids={0})]
    blocking, _, _ = charged(False, reqs, 0.5)
    auto, auto_time, engine = charged("auto", reqs, 0.5)
    weighed, weighed_time, every = charged("auto", reqs, 0.5, Always())
    assert auto == weighed == blocking  # I8: timing only
    assert every.unweighed_ticks == 0 and engine.unweighed_ticks > 200
    assert engine.ahead_ticks + engine.behind_ticks == len(engine.choices) < 80  # the weighed ticks only
    assert engine.choose_host == pytest.approx(0.5 * len(engine.choices))
    assert auto_time < weighed_time - 0.25 * engine.unweighed_ticks


def test_where_choosing_buys_more_than_it_costs_every_tick_is_weighed():
    # A skill that surely ends at its third token, on a device that sets the
    # pace (a forward of 2.0, a host tick of 0.2 and the choice's 0.2):
    # going behind there saves a zombie step, far more than the choice's
    # host time. (Where the host set the pace, behind would buy little, and
    # rightly go unweighed.)
    reqs = [Request(prompt=(3, 5), max_tokens=8, decode_state=Three) for _ in range(200)]
    blocking, _, _ = charged(False, reqs, 0.2, forward=2.0, host=0.1)
    auto, _, engine = charged("auto", reqs, 0.2, forward=2.0, host=0.1)
    assert auto == blocking
    assert engine.unweighed_ticks == 0 and engine.choices.count(False) > 10
    assert engine.worth.weighed > WARMUP and engine.worth.gain * WORTH > engine.worth.cost


def test_a_workload_whose_ends_become_likely_is_weighed_at_every_tick_again():
    # Long text first (choices buy nothing: most ticks unweighed), then
    # three-token answers one after another: the sampled choices learn the
    # third token's end, go behind there and buy a zombie step each, and
    # from then on every tick is weighed.
    backend = FakeBackend(model=FakeModel(), timing=Timing(forward=2.0, sampling=0.0, copy=0.0, launch_cost=0.4,
                                                             finalize_cost=0.4))
    engine = Engine(backend, pipelined="auto", clock=lambda: backend.clock.host)
    engine.arrivals = lambda: backend.clock.spend(0.5) and 0
    engine.submit(Request(prompt=(0, 5), max_tokens=250, stop_ids={0}))
    engine.run_until_idle(max_ticks=2000)
    skipped = engine.unweighed_ticks
    assert skipped > 200
    for _ in range(15):  # about 4 ticks each: its sampled ticks learn that the third token ends
        engine.submit(Request(prompt=(3, 5), max_tokens=8, decode_state=Three, skill="three"))
        engine.run_until_idle(max_ticks=50)
    assert engine.unweighed_ticks - skipped < 40
    before = engine.unweighed_ticks
    for _ in range(25):
        engine.submit(Request(prompt=(3, 5), max_tokens=8, decode_state=Three, skill="three"))
        engine.run_until_idle(max_ticks=50)
    assert engine.unweighed_ticks == before
