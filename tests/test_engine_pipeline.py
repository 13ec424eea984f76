"""What the pipeline promises beyond the invariants: the probes tell the
seed's story, no sequence or arrival starves, adapter slots are held and
reused, spatial values reach the skill, and a misbehaving backend or skill
fails only what it touched.

Each was a gap that mutation testing found (docs/verification.md): the core
could change there without any other test noticing.
"""

from __future__ import annotations

from typing import Callable

import attrs
import pytest

from bubblefree.core import Engine, InvariantViolation, Request, Status, ValueKind
from bubblefree.fake_backend import FakeBackend, FakeModel

MODEL = FakeModel()
PROMPT = (2, 5)  # EOS is the 2nd generated token


def test_probes_of_one_request_through_the_pipeline():
    # The seed's story for one request whose EOS lands while step t+1 runs.
    seen = []
    engine = Engine(FakeBackend(zero_cost=True), probe=seen.append)
    engine.submit(Request(prompt=PROMPT, max_tokens=3, stop_ids={0}))
    engine.run_until_idle()
    two, busy = "two_steps_in_flight_for_one_sequence", "both_slots_busy"
    assert seen == [two, busy, two, busy, "stop_with_successor_launched",
                    "zombie_commit_skipped", "zombie_last_commit_frees_pages"]


def test_a_prefill_is_not_starved_by_running_decodes():
    seen = []
    engine = Engine(FakeBackend(zero_cost=True), probe=seen.append)
    engine.submit(Request(prompt=(0, 1), max_tokens=8))
    for _ in range(3):
        engine.tick()
    engine.submit(Request(prompt=(0, 2), max_tokens=2))
    engine.tick()
    launches = [e for e in engine.trace if e[0] == "launch"]
    assert launches[-1][2:] == ("prefill", launches[-1][3], (1,))  # the very next step
    assert seen.count("prefill_launched_while_decode_in_flight") == 1


def test_decode_batches_rotate_when_more_sequences_run_than_fit():
    # Three running sequences, two rows a step: while all three run, each
    # is in two of every three decode steps; none waits for the others to end.
    engine = Engine(FakeBackend(zero_cost=True, max_rows=2))
    for k in range(3):
        engine.submit(Request(prompt=(0, k), max_tokens=8))
    engine.run_until_idle()
    launches = [e for e in engine.trace[:engine.trace.index(next(e for e in engine.trace if e[0] == "end"))]
                if e[0] == "launch"]
    last_prefill = max(i for i, e in enumerate(launches) if e[2] == "prefill")
    window = [e[4] for e in launches[last_prefill + 1:]]
    assert len(window) >= 6
    for seq in range(3):
        assert sum(seq in rows for rows in window) >= len(window) // 2, f"sequence {seq} starved: {window}"


@attrs.define(eq=False, kw_only=True)
class Recording(FakeBackend):
    """The fake GPU, recording each plan, and able to misreport a step's output."""

    plans: list = attrs.Factory(list)
    tamper: Callable | None = None  # (StepOutput) -> StepOutput

    def launch(self, slot, plan):
        super().launch(slot, plan)
        self.plans.append(plan)

    def wait(self, slot):
        out = super().wait(slot)
        return out if self.tamper is None else self.tamper(out)


def test_an_adapter_slot_is_held_for_the_request_and_then_reused():
    seen = []
    backend = Recording(zero_cost=True, num_adapter_slots=1)
    engine = Engine(backend, probe=seen.append)
    first = engine.submit(Request(prompt=(2, 1), max_tokens=4, stop_ids={0}, adapter="a"))
    second = engine.submit(Request(prompt=(2, 1), max_tokens=4, stop_ids={0}, adapter="b"))
    engine.run_until_idle()
    assert first.result.status is second.result.status is Status.COMPLETED
    assert {row.adapter_slot for plan in backend.plans for row in plan.rows} == {0}
    assert "queued_for_adapters" in seen and "admitted_after_waiting" in seen
    assert not engine.scheduler._waited  # admitted: nothing kept about its wait
    second_prefill = next(i for i, e in enumerate(engine.trace) if e[0] == "launch" and e[4] == (1,))
    assert engine.trace.index(("end", 0, "completed", "stop")) < second_prefill
    assert engine.scheduler.adapters.num_free == 1


def test_a_request_waiting_for_a_row_slot_says_so():
    seen = []
    engine = Engine(FakeBackend(zero_cost=True, max_seqs=1), probe=seen.append)
    for _ in range(2):
        engine.submit(Request(prompt=(2, 1), max_tokens=4, stop_ids={0}))
    engine.run_until_idle()
    assert seen.count("queued_for_rows") == 1 and seen.count("admitted_after_waiting") == 1


@attrs.define(eq=False)
class Recorder:
    """A free-text DecodeState that keeps what the commit hands it; with
    ``kinds``, it asks those values in turn (None: no value)."""

    got: list = attrs.Factory(list)
    kinds: tuple = ()

    def mask_id(self):
        return None

    def value_kind(self):
        return self.kinds[len(self.got) % len(self.kinds)] if self.kinds else None

    def advance(self, token, value):
        self.got.append((token, value))
        return False


def test_each_token_reaches_the_skill_with_the_value_it_asked_for():
    model = FakeModel(value_fn=lambda prompt, position, token, kind: (
        (position + token) / 100 if kind is ValueKind.COORD else (position / 100, token / 100)))
    engine = Engine(FakeBackend(zero_cost=True, model=model))
    kinds = (ValueKind.COORD, None, ValueKind.SIZE)
    states = []
    engine.submit(Request(prompt=(0, 3), max_tokens=6,
                          decode_state=lambda: states.append(Recorder(kinds=kinds)) or states[-1]))
    engine.run_until_idle()
    want = model.expect((0, 3), 6, state=Recorder(kinds=kinds))
    assert states[0].got == list(zip(want.tokens, want.values))
    assert [v is None for _, v in states[0].got] == [False, True, False] * 2
    # The value row's next input is the value's marker, so later tokens differ
    # from the same request asking no values.
    assert want.tokens != model.generate((0, 3), 6)


def test_the_finisher_gets_the_committed_tokens_and_the_skill_state():
    engine = Engine(FakeBackend(zero_cost=True))
    h = engine.submit(Request(prompt=(0, 3), max_tokens=3, decode_state=Recorder,
                              finisher=lambda tokens, state: (tokens, state.got)))
    engine.run_until_idle()
    tokens = MODEL.generate((0, 3), 3)
    assert h.result.output == (tokens, [(t, None) for t in tokens])


def test_a_backend_reporting_the_wrong_row_count_fails_that_step():
    backend = Recording(zero_cost=True)
    backend.tamper = lambda out: attrs.evolve(out, tokens=out.tokens[:1]) if out.step_id == 1 else out
    engine = Engine(backend, pipelined=False)
    a = engine.submit(Request(prompt=(0, 1), max_tokens=4))
    b = engine.submit(Request(prompt=(0, 2), max_tokens=4))
    engine.run_until_idle()
    for h in (a, b):
        assert h.result.status is Status.FAILED
        assert h.result.finish_reason == "backend returned 1 tokens for 2 rows"


def test_a_token_outside_its_mask_is_refused_I9():
    backend = Recording(zero_cost=True)
    engine = Engine(backend)
    odd = engine.register_mask(range(1, 32, 2))
    backend.tamper = lambda out: attrs.evolve(out, tokens=(2,))  # even: not allowed

    class Odd(Recorder):
        def mask_id(self):
            return odd

    engine.submit(Request(prompt=(0, 1), max_tokens=3, decode_state=Odd))
    with pytest.raises(InvariantViolation, match="I9: sequence 0 sampled 2, not allowed by mask"):
        engine.run_until_idle()


class Raises(Recorder):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def mask_id(self):
        if self.where == "mask_id":
            raise RuntimeError("a skill bug in mask_id")
        return None

    def advance(self, token, value):
        if self.where == "advance":
            raise RuntimeError("a skill bug in advance")
        return False


@pytest.mark.parametrize("where", ["advance", "mask_id"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
def test_a_raising_decode_state_fails_only_its_own_request(where, pipelined):
    engine = Engine(FakeBackend(zero_cost=True), pipelined=pipelined)
    good = engine.submit(Request(prompt=(3, 5), max_tokens=4, stop_ids={0}))
    bad = engine.submit(Request(prompt=(0, 5), max_tokens=4, stop_ids={0}, decode_state=lambda: Raises(where)))
    engine.run_until_idle(max_ticks=100)
    engine.check_integrity()
    assert bad.result.status is Status.FAILED
    assert bad.result.finish_reason == f"decode state raised RuntimeError in {where}: a skill bug in {where}"
    assert good.result.status is Status.COMPLETED and good.result.tokens == MODEL.generate((3, 5), 4)


def test_a_listener_may_cancel_another_request_with_a_step_in_flight():
    # Listeners run after the tick, outside the state machine. A's listener
    # cancels B, which the step launched in that tick holds: B becomes a
    # zombie of it, and its pages come back once, at that step's commit.
    seen = []
    engine = Engine(FakeBackend(zero_cost=True), probe=seen.append)
    a = engine.submit(Request(prompt=(0, 5), max_tokens=6))
    b = engine.submit(Request(prompt=(0, 6), max_tokens=6))
    a.listeners.append(lambda h, token: len(h.tokens) == 2 and token is not None and b.cancel())
    while engine.tick():
        engine.check_integrity()
    assert b.result.status is Status.CANCELLED and b.result.tokens == MODEL.generate((0, 6), 2)
    assert a.result.tokens == MODEL.generate((0, 5), 6)
    assert seen.count("zombie_commit_skipped") == 1 and seen.count("zombie_last_commit_frees_pages") == 1
    assert engine.scheduler.pages.num_free == engine.backend.capacity.num_pages


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
@pytest.mark.parametrize("cancel_at", [1, 2, 3])
def test_a_listener_may_cancel_its_own_request(cancel_at, pipelined):
    # A client-side stop condition, run after the tick. Before the last token
    # the request ends cancelled, once (I7); on the last (EOS is the 3rd) it
    # has already completed, and the late cancel is refused.
    engine = Engine(FakeBackend(zero_cost=True), pipelined=pipelined)
    h = engine.submit(Request(prompt=(3, 5), max_tokens=6, stop_ids={0}))
    other = engine.submit(Request(prompt=(0, 5), max_tokens=6, stop_ids={0}))
    h.listeners.append(lambda handle, token: token is not None and len(handle.tokens) == cancel_at
                       and handle.cancel())
    engine.run_until_idle(max_ticks=50)
    engine.check_integrity()
    status = Status.CANCELLED if cancel_at < 3 else Status.COMPLETED
    assert h.result.status is status and h.result.tokens == MODEL.generate((3, 5), cancel_at)
    assert other.result.tokens == MODEL.generate((0, 5), 6) and not engine.listener_errors


def test_a_request_cancelled_while_waiting_for_pages_leaves_nothing_behind():
    engine = Engine(FakeBackend(zero_cost=True, num_pages=2, page_size=2))
    engine.submit(Request(prompt=(0, 1), max_tokens=3))  # takes both pages
    waiting = engine.submit(Request(prompt=(0, 1), max_tokens=3))
    engine.tick()
    assert engine.scheduler._waited == {waiting.request_id}
    engine.cancel(waiting.request_id)
    engine.run_until_idle()
    assert not engine.scheduler._waited and waiting.result.status is Status.CANCELLED


def test_running_decodes_are_not_starved_by_a_stream_of_arrivals():
    # Prefill and decode alternate when both wait: a new request every tick
    # must not hold a running sequence's decode back for more than one step.
    engine = Engine(FakeBackend(zero_cost=True))
    first = engine.submit(Request(prompt=(0, 1), max_tokens=6))
    for k in range(5):
        engine.submit(Request(prompt=(0, 2 + k), max_tokens=2))
        engine.tick()
    launches = [e for e in engine.trace if e[0] == "launch"]
    assert [e[2] for e in launches] == ["prefill", "decode", "prefill", "decode", "prefill"]
    assert [first.request_id in e[4] for e in launches if e[2] == "decode"] == [True, True]
