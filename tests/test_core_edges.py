"""The core's edges that only a second sample, a run-time value or a whole
message shows: the running means of ``auto`` after differing samples, each
skill's end rate kept under its own name, "auto" built at run time,
delivery that a listener re-enters, ``register_mask``'s refusals in full,
``check_plan``'s named checks at every edge of a valid plan, and a step
whose tokens and values are both malformed. Pure core on the fake."""

from __future__ import annotations

import attrs
import pytest

import bubblefree.core.protocol as protocol
from bubblefree.core import Engine, Request, StepKind
from bubblefree.core.ahead import check_mode
from bubblefree.core.ahead_measures import Timings
from bubblefree.core.protocol import PlanRejected, check_mask, check_plan
from bubblefree.fake_backend import FakeBackend
from tests.test_core_ahead import FakeClock
from tests.test_core_plan_checks import CAP, GOOD, VOCAB


def test_each_running_mean_smooths_its_own_kinds_samples_under_a_second():
    clock = FakeClock()
    t = Timings(clock)
    for step, (launch_host, forward) in enumerate([(0.2, 0.5), (0.4, 0.25)]):
        start = clock.now
        clock.now += launch_host
        t.launched(step, start)
        clock.now += forward
        arrived = t.arrived(step)
        clock.now += 0.1 * (step + 1)  # commit bookkeeping: 0.1, then 0.2
        t.committed(arrived)
    t.launched(9, clock.now, StepKind.PREFILL)  # another kind: its own mean
    assert t.launch_host == pytest.approx(0.2 + 0.2 * (0.4 - 0.2))
    assert t.forward == pytest.approx(0.5 + 0.2 * (0.25 - 0.5))
    assert t.commit_host == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))
    assert t.launch_hosts[StepKind.PREFILL] == 0.0 and StepKind.PREFILL not in t.forwards


def test_auto_built_at_run_time_is_auto():
    mode = "".join(["au", "to"])  # equal to the literal, not the same object
    check_mode(mode)
    assert Engine(FakeBackend(zero_cost=True), pipelined=mode).pipelined == "auto"
    for bad in ("Auto", 1, None, "true"):
        with pytest.raises(ValueError, match="^pipelined: must be True, False or \"auto\", got "):
            check_mode(bad)


def test_each_skill_learns_its_own_end_rate():
    engine = Engine(FakeBackend(zero_cost=True), pipelined="auto")
    for skill in ("a", "b"):
        engine.submit(Request(prompt=(0, 5), max_tokens=4, stop_ids={0}, skill=skill))
    engine.run_until_idle(max_ticks=100)
    assert set(engine.end_rates.counts) == {"a", "b"}


def test_a_listener_that_cancels_another_request_is_not_interrupted_by_its_delivery():
    """Delivery is not re-entered: the cancelled request's listeners run
    after the listener that cancelled it returns, and ``delivering`` says
    True only while listeners run."""
    engine = Engine(FakeBackend(zero_cost=True))
    log = []
    a = engine.submit(Request(prompt=(0, 1), max_tokens=3))
    b = engine.submit(Request(prompt=(0, 2), max_tokens=50))

    def on_a(handle, token):
        log.append(("a", token, engine.delivering))
        if token is not None and len(log) == 1:
            engine.cancel(b.request_id)
            log.append(("a cancelled b",))

    a.listeners.append(on_a)
    b.listeners.append(lambda handle, token: log.append(("b", token, engine.delivering)))
    assert engine.delivering is False
    engine.run_until_idle(max_ticks=100)
    assert engine.delivering is False
    first = log.index(("a cancelled b",))
    assert log[first - 1][0] == "a"
    assert all(entry[2] is True for entry in log if len(entry) == 3)
    assert b.result.status.name == "CANCELLED" and a.result.status.name == "COMPLETED"


def test_register_masks_refusals_in_full():
    engine = Engine(FakeBackend(zero_cost=True))
    vocab = engine.backend.vocab_size
    with pytest.raises(ValueError) as err:
        engine.register_mask({3, -1, vocab, "a", 2.5, vocab + 1, vocab + 2})
    assert str(err.value) == (f"mask must be a non-empty set of int token ids < {vocab}; outside it: "
                              f"'a', -1, 2.5, {vocab}, {vocab + 1}")  # by repr, the first five
    with pytest.raises(ValueError) as err:
        engine.register_mask(set())
    assert str(err.value) == f"mask must be a non-empty set of int token ids < {vocab}"
    with pytest.raises(PlanRejected) as err:
        check_mask(frozenset({3, -1, 64, "a", 2.5, 65, 66}), 64)
    assert str(err.value) == ("register_mask: tokens ['a', -1, 2.5, 64, 65] are outside the "
                              "vocabulary [0, 64)")
    with pytest.raises(PlanRejected) as err:
        check_mask(frozenset(), 64)
    assert str(err.value) == "register_mask: an empty allowed-token set can never be sampled"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_the_named_checks_pass_every_valid_plan_at_its_edges(name, monkeypatch):
    """The fast path passes these; here the named checks run on them too
    (as they do after the fast path refuses a plan for another reason): none
    may fire, so only the last line of defence speaks."""
    monkeypatch.setattr(protocol, "_plan_ok", lambda *a: False)
    with pytest.raises(PlanRejected) as err:
        check_plan(GOOD[name], CAP, VOCAB)
    assert str(err.value) == "step 7: refused by the contract's checks"


def test_a_step_with_a_wrong_row_count_fails_even_when_its_values_are_malformed_too():
    from tests.test_engine_pipeline import Recording
    backend = Recording(zero_cost=True)
    backend.tamper = lambda out: (attrs.evolve(out, tokens=out.tokens[:1], values=(0.5, 0.5, 0.5))
                                  if out.step_id == 1 else out)
    engine = Engine(backend, pipelined=False)
    handles = [engine.submit(Request(prompt=(0, i), max_tokens=4)) for i in (1, 2)]
    engine.run_until_idle()
    assert [h.result.finish_reason for h in handles] == ["backend returned 1 tokens for 2 rows"] * 2
