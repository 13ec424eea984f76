"""The stateful property test: Engine + FakeBackend under Hypothesis.

Rules submit requests (prompt length, max_tokens, EOS position, constrained
or not, sampled or greedy, with an image or not, asking coordinate and size
values or not), tick, cancel, inject faults, exhaust pages and send bad
input; the timing of every step (slow forwards, delayed copies) is drawn
from the test's data, and so is each tick's order: the engine runs in the
auto mode with a choice oracle (at the tick's end, leave the step it
finalized in flight for the next launch, commit it now, or the auto rule's
own choice), and a rule switches the mode to
pipelined, blocking or auto mid-flight, so ticks of every order mix. After
every step each invariant is checked by its id.
At teardown the engine is drained and the same workload is replayed in
blocking mode: I8 says the tokens and the values agree.

The rare situations the pipeline must survive are counted through the
engine's probe and reported with ``hypothesis.event``; the test fails if any
of them never happened during the run.
"""

from __future__ import annotations

import collections

import attrs
import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import (
    Bundle, RuleBasedStateMachine, consumes, invariant, rule, run_state_machine_as_test,
)

from bubblefree.core import Engine, ImageRef, InvalidRequest, Request, SamplingParams, Status, ValueKind
from bubblefree.core.values import bad_value
from bubblefree.fake_backend import FakeBackend, FakeModel, Fault, Timing, by_step

VOCAB = 16
EOS = 0
# Masks of the constrained requests: a cycle through three sets, the middle
# one holding EOS so a constrained request may end early.
MASK_SETS = (frozenset({1, 2, 3}), frozenset({EOS, 4, 5}), frozenset({6, 7, 8, 9}))
# What a request's skill asks beside its tokens, in turn (a pattern per Spec.values).
VALUE_PATTERNS = ((), (ValueKind.COORD,), (ValueKind.COORD, ValueKind.COORD, ValueKind.SIZE),
                  (None, ValueKind.SIZE, ValueKind.COORD))

RARE = (
    "zombie_commit_skipped",
    "two_steps_in_flight_for_one_sequence",
    "both_slots_busy",
    "stop_with_successor_launched",
    "cancel_in_flight",
    "queued_for_pages",
    "queued_for_adapters",
    "admitted_after_waiting",
    "zombie_last_commit_frees_pages",
    "prefill_launched_while_decode_in_flight",
    "image_prefill_launched_while_decode_in_flight",
    "decode_launched_after_an_uncommitted_value",
)
SEEN: collections.Counter[str] = collections.Counter()


@attrs.define(eq=False)
class Cycle:
    """A tiny skill: allowed sets cycle (none: free text); done after
    ``length`` tokens (0: never); asks ``kinds`` of values in turn. Records
    (mask id, token) pairs and (kind, value) pairs so the test checks I9 and
    I13 itself, and so that what it received is checked against the
    committed tokens (the skills contract: every committed token, the stop
    token included, in order, exactly once)."""

    mask_ids: tuple[int, ...]
    length: int
    kinds: tuple[ValueKind | None, ...] = ()
    at: int = 0
    seen: list[tuple[int, int]] = attrs.Factory(list)
    values: list[tuple] = attrs.Factory(list)  # (kind asked, value received)

    def mask_id(self) -> int | None:
        return self.mask_ids[self.at % len(self.mask_ids)] if self.mask_ids else None

    def value_kind(self) -> ValueKind | None:
        return self.kinds[self.at % len(self.kinds)] if self.kinds else None

    def advance(self, token: int, value) -> bool:
        self.seen.append((self.mask_id(), token))
        self.values.append((self.value_kind(), value))
        self.at += 1
        return self.at == self.length


@attrs.frozen
class Spec:
    """A submitted request, kept to replay it in blocking mode."""

    prompt: tuple[int, ...]
    max_tokens: int
    constrained: int  # 0: free text; else the Cycle length
    temperature: float
    adapter: bool = False  # names an adapter: contends for the one adapter slot
    image: tuple[int, int] | None = None  # (prefix length, fingerprint)
    values: int = 0  # index into VALUE_PATTERNS


def build_request(spec: Spec, mask_ids: tuple[int, ...], states: list) -> Request:
    factory = None
    if spec.constrained or spec.values:
        def factory():
            state = Cycle(mask_ids if spec.constrained else (), spec.constrained, VALUE_PATTERNS[spec.values])
            states.append(state)
            return state
    sampling = SamplingParams(temperature=spec.temperature, seed=len(spec.prompt) * 31 + spec.prompt[-1])
    image = None if spec.image is None else ImageRef(spec.image[0], source=spec.image[1])
    return Request(prompt=spec.prompt, max_tokens=spec.max_tokens, stop_ids={EOS}, image=image,
                   sampling=sampling, decode_state=factory, adapter="lora" if spec.adapter else None)


@attrs.define(eq=False)
class Choosing(Engine):
    """Auto mode with a choice oracle, for the choice at a tick's end:
    ``oracle`` True leaves the step finalized in flight (the next launch goes
    ahead of its commit), False commits it now, None leaves it to the auto
    rule (which runs either way: its outlook must change nothing)."""

    oracle: bool | None = None

    def _ahead(self) -> bool:
        own = super()._ahead()
        return own if self.oracle is None else self.oracle


def new_engine(pipelined: bool | str, timing: Timing | None, faults: dict, probe=lambda s: None) -> Engine:
    backend = FakeBackend(model=FakeModel(vocab_size=VOCAB, eos_id=EOS), timing=timing, faults=faults,
                          num_pages=12, page_size=2, max_rows=3, max_seqs=4, max_prefill_tokens=12,
                          max_context=24, num_adapter_slots=1)
    return Choosing(backend, pipelined=pipelined, probe=probe, clock=lambda: backend.clock.host)


def bound_of(specs: dict[int, Spec]) -> int:
    """Ticks by which every request must have ended (termination): even one
    at a time, a request needs a prefill, its decodes and a last commit."""
    return 10 + sum(spec.max_tokens + 3 for spec in specs.values())


class PipelineMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.forward: dict[int, float] = {}
        self.copy: dict[int, float] = {}
        self.faults: dict[int, Fault] = {}
        timing = Timing(forward=by_step(self.forward, 1.0), copy=by_step(self.copy, 0.02))
        self.engine = new_engine("auto", timing, self.faults, probe=self._probe)
        self.mask_ids = tuple(self.engine.register_mask(m) for m in MASK_SETS)
        self.specs: dict[int, Spec] = {}
        self.all: list = []
        self.ends: collections.Counter[int] = collections.Counter()
        self.skill_of: dict[int, list[Cycle]] = {}  # request id -> its skill state, once admitted
        self.faulted = False

    def _probe(self, situation: str) -> None:
        SEEN[situation] += 1
        event(situation)

    def _next_step(self) -> int:
        return self.engine.scheduler._next_step

    # ------------------------------------------------------------------ rules
    @rule(target=handles,
          prompt_len=st.integers(1, 4), max_tokens=st.integers(1, 6), eos_at=st.integers(0, 7),
          constrained=st.integers(0, 5), sampled=st.booleans(), rest=st.integers(1, VOCAB - 1),
          adapter=st.booleans(), image=st.none() | st.tuples(st.integers(1, 3), st.integers(0, 3)),
          values=st.integers(0, len(VALUE_PATTERNS) - 1))
    def submit(self, prompt_len, max_tokens, eos_at, constrained, sampled, rest, adapter, image, values):
        prompt = (eos_at,) + tuple((rest + i) % (VOCAB - 1) + 1 for i in range(prompt_len - 1))
        spec = Spec(prompt, max_tokens, constrained, 0.8 if sampled else 0.0, adapter, image, values)
        states = []  # the request's skill state, once admitted
        handle = self.engine.submit(build_request(spec, self.mask_ids, states))
        self.skill_of[handle.request_id] = states
        handle.listeners.append(self._listen)
        self.specs[handle.request_id] = spec
        self.all.append(handle)
        return handle

    @rule(target=handles, max_tokens=st.integers(12, 20))
    def exhaust_pages(self, max_tokens):
        """A request needing most of the cache: others queue behind it."""
        spec = Spec((0, 3, 4), max_tokens, 0, 0.0)
        handle = self.engine.submit(build_request(spec, self.mask_ids, []))
        self.skill_of[handle.request_id] = []
        handle.listeners.append(self._listen)
        self.specs[handle.request_id] = spec
        self.all.append(handle)
        return handle

    def _listen(self, handle, token) -> None:
        if token is None:
            self.ends[handle.request_id] += 1

    @rule(forward=st.sampled_from([0.01, 0.3, 1.0, 4.0]), copy=st.sampled_from([0.0, 0.02, 2.0, 9.0]),
          ahead=st.sampled_from([True, False, None]))
    def tick(self, forward, copy, ahead):
        step = self._next_step()
        self.forward[step], self.copy[step] = forward, copy  # slow forwards, delayed copies
        self.engine.oracle = ahead  # the choice at this tick's end, in auto mode
        self.engine.tick()

    @rule(n=st.integers(2, 8))
    def tick_many(self, n):
        self.engine.oracle = None
        for _ in range(n):
            self.engine.tick()

    @rule(mode=st.sampled_from([True, False, "auto"]))
    def switch_mode(self, mode):
        """Pipelined, blocking or auto from the next tick on, steps in flight."""
        self.engine.pipelined = mode

    @rule(handle=handles)
    def cancel(self, handle):
        was_done = handle.done
        before = list(handle.tokens)
        ok = self.engine.cancel(handle.request_id)
        assert ok != was_done, "cancel returns True exactly when the request was still live"
        assert handle.done and handle.tokens == before
        if ok:
            assert handle.result.status is Status.CANCELLED

    @rule(handle=consumes(handles))
    def forget(self, handle):
        """Drop a handle from the bundle so later rules pick among fresher ones."""

    @rule(kind=st.sampled_from(["launch", "finalize", "sampling", "copy"]), ahead=st.integers(0, 1))
    def inject_fault(self, kind, ahead):
        self.faults[self._next_step() + ahead] = Fault(kind, f"injected {kind} fault")
        self.faulted = True

    @rule(which=st.sampled_from(["empty", "max_tokens", "context", "token", "stop"]))
    def bad_input(self, which):
        """Bad input is refused with an error naming the field; the engine
        keeps serving (the invariants below still hold after it)."""
        kw = {"empty": dict(prompt=(), max_tokens=2), "max_tokens": dict(prompt=(1,), max_tokens=0),
              "context": dict(prompt=(1, 2), max_tokens=40), "token": dict(prompt=(VOCAB,), max_tokens=1),
              "stop": dict(prompt=(1,), max_tokens=1, stop_ids={VOCAB + 3})}[which]
        field = {"empty": "prompt", "max_tokens": "max_tokens", "context": "max_tokens",
                 "token": "prompt", "stop": "stop_ids"}[which]
        live = len(self.engine.handles)
        try:
            self.engine.submit(Request(**kw))
        except InvalidRequest as err:
            assert str(err).startswith(field), err
        else:
            raise AssertionError(f"bad {which} accepted")
        assert len(self.engine.handles) == live

    # ------------------------------------------------------------- invariants
    @invariant()
    def structure_I2_I3_I4_I6(self):
        self.engine.check_integrity()

    @invariant()
    def nothing_after_the_end_I5(self):
        for h in self.all:
            spec = self.specs[h.request_id]
            assert len(h.tokens) <= spec.max_tokens, "I5: more than max_tokens"
            if EOS in h.tokens:
                assert h.tokens.index(EOS) == len(h.tokens) - 1, "I5: token after EOS"
            if h.done:
                assert tuple(h.tokens) == h.result.tokens, "I5: token appended after the result"

    @invariant()
    def each_request_ends_at_most_once_I7(self):
        for h in self.all:
            assert self.ends[h.request_id] == (1 if h.done else 0), "I7"

    @invariant()
    def masks_hold_I9(self):
        allowed = dict(zip(self.mask_ids, MASK_SETS))
        for states in self.skill_of.values():
            for state in states:
                for mask_id, token in state.seen:
                    assert mask_id is None or token in allowed[mask_id], "I9: committed token outside its mask"

    @invariant()
    def values_hold_I13(self):
        for states in self.skill_of.values():
            for state in states:
                for kind, value in state.values:
                    assert bad_value(kind, value) is None, f"I13: {kind} asked, {value!r} received"

    @invariant()
    def a_skill_receives_every_committed_token(self):
        # The skills contract (docs/contracts.md): every committed token, the
        # stop token included, in order, exactly once; none after the end.
        for h in self.all:
            for state in self.skill_of[h.request_id]:
                got = [token for _, token in state.seen]
                assert got == list(h.tokens), f"skill received {got}, committed {h.tokens}"

    @invariant()
    def one_compute_stream_I1(self):
        # Forwards and samplings execute in launch order, never overlapping.
        prev_end = None
        for step_id, what, start, end in self.engine.backend.clock.compute.intervals:
            assert prev_end is None or start >= prev_end, "I1"
            prev_end = end

    # --------------------------------------------------------------- teardown
    def teardown(self):
        # Termination: even fully serialized (one request at a time), each
        # request needs at most a prefill, its decodes and one trailing commit.
        self.engine.run_until_idle(max_ticks=bound_of(self.specs))
        self.engine.check_integrity()
        sched = self.engine.scheduler
        assert not sched.seqs and not sched.queue and not sched.inflight
        assert sched.pages.num_free == sched.pages.size, "I6: pages lost"
        for h in self.all:
            assert h.done and self.ends[h.request_id] == 1, "I7: a request never ended"
            if h.result.status is Status.FAILED:
                assert h.result.finish_reason.startswith("injected"), h.result.finish_reason
        self._check_blocking_agrees_I8()

    def _check_blocking_agrees_I8(self):
        """Replay the accepted requests in blocking mode without cancels or
        faults. Completed requests agree token for token; a cancelled or
        failed one holds a prefix of what it would have produced."""
        blocking = new_engine(False, None, {})
        ids = tuple(blocking.register_mask(m) for m in MASK_SETS)
        assert ids == self.mask_ids
        states = {h.request_id: [] for h in self.all}
        replay = {h.request_id: blocking.submit(build_request(self.specs[h.request_id], ids, states[h.request_id]))
                  for h in self.all}
        blocking.run_until_idle(max_ticks=bound_of(self.specs))
        for h in self.all:
            ref = replay[h.request_id].result
            assert ref.status is Status.COMPLETED
            if h.result.status is Status.COMPLETED:
                assert h.result.tokens == ref.tokens, "I8: pipelined and blocking disagree"
                assert h.result.finish_reason == ref.finish_reason, "I8"
            else:
                assert ref.tokens[:len(h.result.tokens)] == h.result.tokens, "I8: prefix"
            mine, theirs = self.skill_of[h.request_id], states[h.request_id]
            if mine:  # admitted here: the values it received are a prefix of the replay's
                assert theirs[0].values[:len(mine[0].values)] == mine[0].values, "I8: values disagree"


def test_pipeline_machine_and_rare_situations():
    """The machine, and a check that it reached every rare situation. That
    check is about the programs drawn, so they are drawn from a fixed seed
    and at least CI's number of them: with a random seed and the dev
    profile's 100, a rare situation was missed about one run in three."""
    SEEN.clear()
    run_state_machine_as_test(
        PipelineMachine, settings=settings(settings.default, stateful_step_count=40, derandomize=True,
                                           max_examples=max(150, settings.default.max_examples)))
    missing = [s for s in RARE if SEEN[s] == 0]
    assert not missing, f"rare situations never reached: {missing}; seen: {dict(SEEN)}"
