"""The core's own edges that the serving-layer tests reach only from above:
a listener that raises (core.Engine), and SamplingParams' checks at their
exact bounds. Kept in the mutation subset, so mutants of these functions
meet a test of the core itself."""

import math
import random

import numpy as np
import pytest

from bubblefree.core import Engine, InvalidRequest, Request, SamplingParams, Status
from bubblefree.core.engine import LISTENER_ERRORS_KEPT
from bubblefree.core.values import GREEDY
from bubblefree.fake_backend import FakeBackend, FakeModel

VOCAB, EOS = 32, 0


def engine() -> Engine:
    return Engine(FakeBackend(model=FakeModel(vocab_size=VOCAB, eos_id=EOS), num_pages=32, max_rows=4))


class Cancelled(BaseException):
    """What asyncio's CancelledError is: a BaseException, not an Exception."""


def raising(when, error=ValueError):
    def listener(handle, token):
        if when(token):
            raise error("boom")
    return listener


def test_a_listener_raising_on_a_token_fails_its_own_request_only():
    e = engine()
    victim = e.submit(Request(prompt=(1, 2), max_tokens=6))
    victim.listeners.append(raising(lambda token: token is not None))
    other = e.submit(Request(prompt=(1, 3), max_tokens=6))
    e.run_until_idle()
    assert victim.result.status is Status.FAILED
    assert victim.result.finish_reason == "a listener raised ValueError: boom"
    assert len(victim.result.tokens) == 1  # failed at its first token, nothing after
    assert other.result.status is Status.COMPLETED and len(other.result.tokens) == 6
    assert ("cancel", victim.request_id) in e.trace
    assert not e.listener_errors
    assert e.scheduler.pages.num_free == e.scheduler.pages.size  # I6: its pages came back
    e.check_integrity()


def test_a_listener_raising_a_base_exception_fails_its_own_request_only():
    e = engine()
    victim = e.submit(Request(prompt=(1, 2), max_tokens=6))
    victim.listeners.append(raising(lambda token: token is not None, Cancelled))
    other = e.submit(Request(prompt=(1, 3), max_tokens=6))
    e.run_until_idle()
    assert victim.result.status is Status.FAILED
    assert victim.result.finish_reason == "a listener raised Cancelled: boom"
    assert other.result.status is Status.COMPLETED and len(other.result.tokens) == 6
    e.check_integrity()


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_a_listener_asking_the_process_to_stop_is_not_taken_as_its_requests_failure(error):
    e = engine()
    victim = e.submit(Request(prompt=(1, 2), max_tokens=6))
    victim.listeners.append(raising(lambda token: token is not None, error))
    with pytest.raises(error):
        e.run_until_idle()
    assert victim.result is None  # not ended by the core: the caller decides (the loop ends all)


def test_a_listener_raising_on_an_ended_request_is_recorded_not_lost():
    e = engine()
    done = e.submit(Request(prompt=(1, 2), max_tokens=3))
    done.listeners.append(raising(lambda token: token is None))  # on the end
    e.run_until_idle()
    assert done.result.status is Status.COMPLETED  # an ended request stays ended (I7)
    assert list(e.listener_errors) == [f"request {done.request_id}: a listener raised ValueError: boom"]
    assert ("cancel", done.request_id) not in e.trace


def test_listener_errors_keep_the_newest():
    e = engine()
    handles = [e.submit(Request(prompt=(1, 2), max_tokens=1)) for _ in range(LISTENER_ERRORS_KEPT + 5)]
    for h in handles:
        h.listeners.append(raising(lambda token: token is None))
    e.run_until_idle()
    assert len(e.listener_errors) == LISTENER_ERRORS_KEPT
    assert e.listener_errors[-1].startswith(f"request {handles[-1].request_id}:")
    assert e.listener_errors[0].startswith(f"request {handles[5].request_id}:")


@pytest.mark.parametrize("value", [0, 0.0, 1e-5, 1, 100, 100.0])
def test_temperature_at_its_bounds_is_taken_as_a_float(value):
    t = SamplingParams(temperature=value).temperature
    assert t == float(value) and type(t) is float


@pytest.mark.parametrize("value", [-1e-9, 9.99e-6, 100.0001, -1, math.inf, -math.inf, math.nan])
def test_temperature_outside_is_refused_naming_the_range(value):
    with pytest.raises(InvalidRequest, match=r"^sampling\.temperature: must be 0 or in \[1e-05, 100\], got "):
        SamplingParams(temperature=value)


@pytest.mark.parametrize("value", [1e-5, 0.5, 1, 1.0])
def test_top_p_at_its_bounds_is_taken(value):
    p = SamplingParams(top_p=value).top_p
    assert p == float(value) and type(p) is float


@pytest.mark.parametrize("value", [0, 0.0, 9.99e-6, 1.0001, math.nan])
def test_top_p_outside_is_refused_naming_the_range(value):
    with pytest.raises(InvalidRequest, match=r"^sampling\.top_p: must be in \[1e-05, 1\], got "):
        SamplingParams(top_p=value)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [True, False, "0.5", None, [0.5]])
def test_a_non_number_is_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=rf"^sampling\.{field}: must be a number, got "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value,message", [
    ("temperature", True, "must be a number, got True"),
    ("top_p", "0.5", "must be a number, got '0.5'"),
    ("temperature", 9.99e-6, "must be 0 or in [1e-05, 100], got 9.99e-06"),  # under low, not 0
    ("temperature", 100.0001, "must be 0 or in [1e-05, 100], got 100.0001"),
    ("temperature", -1, "must be 0 or in [1e-05, 100], got -1.0"),  # the int, as the float it became
    ("top_p", 0, "must be in [1e-05, 1], got 0.0"),  # 0 is the temperature's alone
    ("top_p", 9.99e-6, "must be in [1e-05, 1], got 9.99e-06"),
    ("top_p", 1.0001, "must be in [1e-05, 1], got 1.0001"),
])
def test_each_refusal_s_whole_message(field, value, message):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert str(err.value) == f"sampling.{field}: {message}"


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_seeds_in_range(seed):
    assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.0, "1"])
def test_seeds_outside_are_refused(seed):
    with pytest.raises(InvalidRequest, match=r"^sampling\.seed: must be an int in \[0, 2\*\*64\) or None, got "):
        SamplingParams(seed=seed)


def test_without_a_seed_one_is_drawn_where_a_token_is_drawn_and_a_seed_given_stays():
    assert SamplingParams().seed is None and SamplingParams(temperature=0.5).seed is None
    draws = iter([11, 12])
    drawn = SamplingParams(temperature=0.5, top_p=0.9).seeded(lambda: next(draws))
    assert drawn == SamplingParams(temperature=0.5, top_p=0.9, seed=11)
    assert SamplingParams().seeded(lambda: next(draws)).seed == 0  # greedy needs none: nothing drawn
    given = SamplingParams(temperature=0.5, seed=3)
    assert given.seeded(lambda: next(draws)) is given
    assert next(draws) == 12


def test_requests_without_a_seed_draw_apart_and_their_seed_draws_the_same_again():
    engine = Engine(FakeBackend(), seeds=random.Random(5))
    drawn = SamplingParams(temperature=1.5)
    handles = [engine.submit(Request(prompt=(0, 1, 2), max_tokens=12, sampling=drawn)) for _ in range(2)]
    engine.run_until_idle()
    seeds = [h.request.sampling.seed for h in handles]
    assert all(type(s) is int for s in seeds) and seeds[0] != seeds[1]
    tokens = [h.result.tokens for h in handles]
    assert tokens[0] != tokens[1]  # 12 tokens of 32 at temperature 1.5: a tie is negligible
    again = engine.submit(Request(prompt=(0, 1, 2), max_tokens=12,
                                  sampling=SamplingParams(temperature=1.5, seed=seeds[0])))
    greedy = engine.submit(Request(prompt=(0, 1, 2), max_tokens=12))
    engine.run_until_idle()
    assert again.result.tokens == tokens[0]
    assert greedy.request.sampling.seed == 0
    # An engine given the same seeds draws the same ones
    twin = Engine(FakeBackend(), seeds=random.Random(5))
    assert [twin.submit(Request(prompt=(0, 1, 2), max_tokens=12, sampling=drawn)).request.sampling.seed
            for _ in range(2)] == seeds


@pytest.mark.parametrize("value", [0, 1, 50, 2**31 - 1, np.int64(7), np.uint8(3)])
def test_top_k_in_range_is_taken_as_an_int(value):
    k = SamplingParams(top_k=value).top_k
    assert k == int(value) and type(k) is int


@pytest.mark.parametrize("value,shown", [(-1, "-1"), (2**31, "2147483648"), (True, "True"), (1.0, "1.0"),
                                         ("5", "'5'"), (None, "None"), (10**400, "an integer of 401 digits")])
def test_top_k_outside_is_refused_naming_the_range(value, shown):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(top_k=value)
    assert str(err.value) == f"sampling.top_k: must be an int in [0, 2**31 - 1] (0: no limit), got {shown}"


@pytest.mark.parametrize("value", [0, 0.0, 1e-5, 0.05, 1, 1.0])
def test_min_p_zero_or_in_range_is_taken_as_a_float(value):
    m = SamplingParams(min_p=value).min_p
    assert m == float(value) and type(m) is float


@pytest.mark.parametrize("value", [-0.1, 9.99e-6, 1.0001, math.nan, math.inf, True, "0.1", None])
def test_min_p_outside_is_refused_naming_it(value):
    with pytest.raises(InvalidRequest, match=r"^sampling\.min_p: must be (0 or in \[1e-05, 1\]|a number), got "):
        SamplingParams(min_p=value)


def test_the_cuts_are_mapping_fields_and_keep_the_positional_order():
    assert SamplingParams.of({"temperature": 0.7, "top_k": 20, "min_p": 0.05}) == \
        SamplingParams(0.7, 1.0, None, top_k=20, min_p=0.05)
    assert SamplingParams(0.5, 0.9, 3) == SamplingParams(temperature=0.5, top_p=0.9, seed=3)


def test_of_none_is_greedy_and_of_params_is_themselves():
    assert SamplingParams.of(None) is GREEDY
    params = SamplingParams(temperature=0.5, seed=3)
    assert SamplingParams.of(params) is params


def test_of_a_mapping_builds_and_checks():
    assert SamplingParams.of({"temperature": 1, "top_p": 0.5, "seed": 7}) == SamplingParams(1.0, 0.5, 7)
    assert SamplingParams.of({}) == GREEDY
    with pytest.raises(InvalidRequest, match=r"^sampling\.top_p: "):
        SamplingParams.of({"top_p": 2})


def test_of_unknown_fields_are_named_sorted():
    with pytest.raises(InvalidRequest, match=r"^sampling: unknown field\(s\) max, temp; "
                                             r"expected temperature, top_p, top_k, min_p, seed$"):
        SamplingParams.of({"temp": 1, "max": 2, "seed": 1})


@pytest.mark.parametrize("value", [[("temperature", 1)], "greedy", 0.5, (1,)])
def test_of_anything_else_is_refused_naming_its_type(value):
    with pytest.raises(InvalidRequest, match=rf"^sampling: must be SamplingParams or a mapping, got {type(value).__name__}$"):
        SamplingParams.of(value)


# -- Engine.submit / cancel / validate and the policy at their exact edges ----
# (survivors of the mutation run: each test below fails under one of them)

def test_a_chosen_request_id_is_used_and_an_id_in_use_refused_even_for_a_zombie():
    from bubblefree.core import Request as Req
    e = engine()
    h = e.submit(Req(prompt=(1, 2), max_tokens=8), request_id=41)
    assert h.request_id == 41
    with pytest.raises(ValueError, match=r"^request id 41 is in use$"):
        e.submit(Req(prompt=(1, 2), max_tokens=8), request_id=41)
    e.tick()  # its prefill is in flight
    assert e.cancel(41)  # ended now: a zombie until its step commits
    assert 41 in e.scheduler.seqs and 41 not in e.handles
    with pytest.raises(ValueError, match=r"^request id 41 is in use$"):
        e.submit(Req(prompt=(1, 2), max_tokens=8), request_id=41)
    e.run_until_idle()
    assert e.submit(Req(prompt=(1, 2), max_tokens=2), request_id=41).request_id == 41  # free again


def test_cancel_with_a_reason_fails_and_without_one_cancels():
    e = engine()
    failed, cancelled = (e.submit(Request(prompt=(1, 2), max_tokens=8)) for _ in range(2))
    assert e.cancel(failed.request_id, reason="the client left")
    assert e.cancel(cancelled.request_id)
    assert not e.cancel(cancelled.request_id)  # already ended
    assert (failed.result.status, failed.result.finish_reason) == (Status.FAILED, "the client left")
    assert (cancelled.result.status, cancelled.result.finish_reason) == (Status.CANCELLED, "cancelled")


def test_scheduler_cancel_says_cancelled_by_default():
    e = engine()
    h = e.submit(Request(prompt=(1, 2), max_tokens=8))
    assert e.scheduler.cancel(h.request_id)
    e.tick()
    assert (h.result.status, h.result.finish_reason) == (Status.CANCELLED, "cancelled")


@pytest.mark.parametrize("req, message", [
    ("not a request", r"^request: must be a Request, got str$"),
    (Request(prompt=(1,), max_tokens=2, sampling={"temperature": 0}),
     r"^sampling: must be SamplingParams, got dict$"),
    (Request(prompt=(1,), max_tokens=2, decode_state=3), r"^decode_state: must be callable or None$"),
    (Request(prompt=(1,), max_tokens=2, finisher="x"), r"^finisher: must be callable or None$"),
])
def test_validate_names_what_is_wrong(req, message):
    e = engine()
    with pytest.raises(InvalidRequest, match=message):
        e.submit(req)
    assert not e.scheduler.seqs  # nothing accepted


def test_the_trace_is_trimmed_only_past_twice_its_limit():
    e = Engine(FakeBackend(model=FakeModel(vocab_size=VOCAB, eos_id=EOS), num_pages=32, max_rows=4),
               trace_limit=3)
    lengths = []
    for i in range(14):
        e._log(("entry", i))
        lengths.append(len(e.trace))
    assert max(lengths) == 6 and lengths[6] == 3  # 7 > 2 x 3: the newest 3 are kept
    assert e.trace[-1] == ("entry", 13)


def test_a_prefill_takes_a_prompt_that_fills_the_budget_exactly():
    from bubblefree.core import Capacity
    from bubblefree.core.policy import choose_step
    from bubblefree.core.sequence import Phase, Sequence
    cap = Capacity(num_pages=16, page_size=4, max_rows=4, max_seqs=4, max_prefill_tokens=10, max_context=64)
    seqs = [Sequence(i, Request(prompt=tuple(range(1, 1 + n)), max_tokens=2)) for i, n in enumerate((4, 6, 1))]
    for s in seqs:
        s.phase = Phase.ADMITTED
    kind, chosen = choose_step(seqs, cap, None)
    assert [s.seq_id for s in chosen] == [0, 1]  # 4 + 6 == 10 fits; the third waits


def test_shown_quotes_a_value_bounded_and_never_raises():
    from bubblefree.core.values import NAME_CHARS, shown

    class Unquotable:
        def __repr__(self):
            raise ValueError("no")
    assert shown("hot") == "'hot'" and shown(1.5) == "1.5" and shown(None) == "None"
    assert shown(10 ** 5000) == "an integer of 5001 digits"  # its repr would raise
    assert shown(Unquotable()) == "a Unquotable (its repr raised)"
    long = shown("x" * 10_000)
    assert long == "'" + "x" * (NAME_CHARS - 1) + "..."
    assert shown("\ud800") == "'\\ud800'"  # a lone surrogate escaped: the message can be printed
    shown("\ud800").encode("utf-8")
