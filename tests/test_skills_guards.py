"""A skill of your own, held to what the engine promises: the engine
compiles its skills before it serves, each once, and its skill set cannot
be swapped; what a skill's submit hooks return is checked under their
guard, naming the skill and the hook; and a skill's bugs at the edges of a
request (``unserved`` raising, ``start`` raising for a request cancelled
while queued, one state handed to two requests) are named or contained."""

from __future__ import annotations

import re
import threading
import time

import attrs
import numpy as np
import pytest

from bubblefree import Engine, Status
from bubblefree.core import Engine as CoreEngine
from bubblefree.fake_backend import FakeBackend
from bubblefree.skills import LocationCodec, SkillSet
from bubblefree.skills.base import SkillError
from bubblefree.skills.registry import BUILTIN
from bubblefree.skills.skillset import _started
from bubblefree.skills.text import Query, TextState
from tests.serving_world import TOK, WAIT, Gate, endless_model, make_engine, reference, wait_idle

MODES = [True, False, "auto"]


# -- compiled before serving, once, and not swapped -------------------------------

@attrs.frozen
class _Counted(Query):
    """Records the thread of each compile; waits up to ``overlap`` seconds
    for a second compile to begin, so two at once would overlap."""
    name: str = "counted"
    threads: list = attrs.field(factory=list, eq=False)
    overlap: float = 0.0

    def compile(self, ctx):
        self.threads.append(threading.current_thread().name)
        deadline = time.monotonic() + self.overlap
        while len(self.threads) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().compile(ctx)


def _uncompiled(skill, registered: list) -> tuple[CoreEngine, SkillSet]:
    core = CoreEngine(FakeBackend(model=endless_model(), num_pages=256, max_rows=8, max_seqs=16))

    def register(allowed):
        registered.append(threading.current_thread().name)
        return core.register_mask(allowed)
    return core, SkillSet(TOK, register, codec=LocationCodec.for_tokenizer(TOK, coord_bins=64, size_bins=16),
                          registry=BUILTIN.with_skill(skill))


def test_the_engine_compiles_its_skills_before_it_serves_and_never_on_a_callers_thread():
    """A skill set handed over uncompiled was compiled at its first submit,
    on a caller's thread, registering masks while the decode thread served."""
    skill, registered = _Counted(), []
    core, skills = _uncompiled(skill, registered)
    eng = Engine(core, skills)
    try:
        here = threading.current_thread().name
        assert skill.threads == [here] and registered and set(registered) == {here}
        before = len(registered)
        callers = [threading.Thread(target=lambda: eng.run("counted", question="the cat", max_tokens=2))
                   for _ in range(3)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(WAIT)
        assert skill.threads == [here] and len(registered) == before
    finally:
        eng.close()


def test_a_skill_compiles_once_when_several_threads_ask_at_once():
    skill = _Counted(overlap=1.0)
    _, skills = _uncompiled(skill, [])
    barrier = threading.Barrier(4)

    def ask():
        barrier.wait()
        skills.tables("counted")
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert len(skill.threads) == 1, skill.threads


def test_a_running_engines_skills_cannot_be_swapped():
    eng = make_engine()
    try:
        with pytest.raises(AttributeError):
            eng.skills = SkillSet(TOK, eng.core.register_mask, codec=eng.skills.codec,
                                  registry=BUILTIN.with_skill(_Counted()))
        assert eng.skills.registry is BUILTIN
    finally:
        eng.close()


# -- what submit hooks return: converted under their guard -------------------------

def _raise(err):
    raise err


@attrs.frozen
class _Returns(Query):
    """``query`` whose hook ``hook`` returns ``answer(tokenizer_or_ctx)``."""
    name: str = "returns"
    hook: str = "prompt"
    answer: object = None

    def prompt(self, tokenizer, args):
        return self.answer(tokenizer) if self.hook == "prompt" else super().prompt(tokenizer, args)

    def stop_ids(self, ctx):
        return self.answer(ctx) if self.hook == "stop_ids" else super().stop_ids(ctx)

    def prompt_values(self, tokenizer, args):
        return self.answer(tokenizer) if self.hook == "prompt_values" else ()

    def budget(self, tables, args):
        return self.answer(None) if self.hook == "budget" else 4


@pytest.fixture
def engine_returning():
    engines = []

    def make(skill):
        engines.append(make_engine(registry=BUILTIN.with_skill(skill)))
        return engines[-1]
    yield make
    for eng in engines:
        eng.close()


@pytest.mark.parametrize("hook,answer,problem", [
    ("prompt", lambda tok: None, "prompt() returned None, not token ids"),
    ("prompt", lambda tok: (_raise(KeyError("t")) for _ in "x"), "raised KeyError in prompt: 't'"),
    ("prompt", lambda tok: [5, len(TOK) + 5], f"prompt() returned {len(TOK) + 5}, not a token id in"),
    ("prompt", lambda tok: ["a", "b"], "prompt() returned 'a', not a token id in"),
    ("prompt", lambda tok: [5, True], "prompt() returned True, not a token id in"),
    ("stop_ids", lambda ctx: None, "stop_ids() returned None, not token ids"),
    ("stop_ids", lambda ctx: {-1}, "stop_ids() returned -1, not a token id in"),
    ("prompt_values", lambda tok: None, "raised TypeError in prompt_values"),
], ids=["prompt-none", "prompt-generator-raises", "prompt-out-of-vocab", "prompt-strs", "prompt-bool",
        "stop-none", "stop-negative", "values-none"])
def test_what_a_submit_hook_returns_is_checked_naming_the_skill_and_the_hook(engine_returning, hook, answer,
                                                                             problem):
    """These escaped as a bare TypeError, or were refused as the caller's
    ``prompt`` or ``stop_ids`` ("token ids must be ints"), naming no skill."""
    eng = engine_returning(_Returns(hook=hook, answer=answer))
    with pytest.raises(SkillError, match=f"^skill 'returns'[: ].*{re.escape(problem)}"):
        eng.submit("returns", question="the cat")
    assert eng.submit("query", question="the cat", max_tokens=3).result(WAIT).status is Status.COMPLETED


@pytest.mark.parametrize("hook,answer", [
    ("prompt", lambda tok: np.array(TOK.encode("the cat"), dtype=np.int64)),
    ("stop_ids", lambda ctx: frozenset({np.int64(ctx.eos_id)})),
    ("budget", lambda _: np.int64(4)),
], ids=["prompt", "stop_ids", "budget"])
def test_numpy_integers_serve_as_a_hooks_ids_and_budget(engine_returning, hook, answer):
    """A budget of ``numpy.int64(4)`` was refused; numpy ids in a prompt or
    the stop ids were refused as the caller's."""
    eng = engine_returning(_Returns(hook=hook, answer=answer))
    result = eng.submit("returns", question="the cat", max_tokens=None).result(WAIT)
    assert result.status is Status.COMPLETED and len(result.tokens) == 4, result.finish_reason


@attrs.frozen
class _UnservedBug(Query):
    name: str = "unserved_bug"

    def unserved(self, codec):
        return {}["codec"]


def test_an_unserved_that_raises_is_named_with_the_skill():
    """A KeyError reached the engine's builder bare."""
    with pytest.raises(SkillError, match=r"^skill 'unserved_bug' raised KeyError in unserved: 'codec'"):
        make_engine(registry=BUILTIN.with_skill(_UnservedBug()))


# -- a request's edges: a start that raises, one state for two requests -------------

@attrs.frozen
class _StartBug(Query):
    name: str = "start_bug"

    def start(self, tables, args, budget):
        raise ValueError("start bug")


@pytest.mark.parametrize("pipelined", MODES)
def test_a_request_cancelled_while_queued_stays_cancelled_when_its_start_raises(pipelined):
    """The finisher started it anyway, and the cancel became a failure "in
    finish: start bug"; admitted, it fails with its first cause."""
    gate = Gate()
    eng = make_engine(registry=BUILTIN.with_skill(_StartBug()), pipelined=pipelined, gate=gate, max_seqs=1)
    try:
        gate.arm(at=1)
        blocker = eng.submit("query", question="the sky", max_tokens=4)  # holds the one sequence slot
        gate.wait_reached()
        queued = eng.submit("start_bug", question="the cat", max_tokens=4)
        queued.cancel()
        gate.open()
        result = queued.result(WAIT)
        assert (result.status, result.output, result.tokens) == (Status.CANCELLED, None, ()), result.finish_reason
        assert blocker.result(WAIT).status is Status.COMPLETED
        result = eng.submit("start_bug", question="the cat", max_tokens=4).result(WAIT)
        assert result.status is Status.FAILED and result.output is None
        assert result.finish_reason == "skill 'start_bug' raised ValueError in decode_state: start bug"
        wait_idle(eng)
    finally:
        gate.open()
        eng.close()


@attrs.frozen
class _SharedState(Query):
    """``start`` hands every request the same state."""
    name: str = "shared"
    states: list = attrs.field(factory=list, eq=False)

    def start(self, tables, args, budget):
        if not self.states:
            self.states.append(TextState(tables))
        return self.states[0]


@pytest.mark.parametrize("pipelined", MODES)
def test_a_state_that_has_consumed_tokens_is_refused_as_not_fresh(pipelined):
    """The second request advanced the first one's state: its output was
    both requests' tokens, merged."""
    registry = BUILTIN.with_skill(_SharedState())
    eng = make_engine(registry=registry, pipelined=pipelined)
    try:
        first = eng.submit("shared", question="the cat", max_tokens=5).result(WAIT)
        assert first.tokens == reference("query", {"question": "the cat"}, None, 5)  # its own, alone
        second = eng.submit("shared", question="a dog", max_tokens=5).result(WAIT)
        assert second.status is Status.FAILED and second.tokens == ()
        assert "start() returned a state that has consumed 5 tokens: each request needs a fresh state" \
            in second.finish_reason, second.finish_reason
        wait_idle(eng)
    finally:
        eng.close()
    # One that starts done is refused too, for what it is: it would be
    # sampled a token, then refuse it as a bug in advance.
    done = TextState(eng.skills.tables("query"), done=True)
    with pytest.raises(SkillError, match="start\\(\\) returned a state that is already done"):
        _started(attrs.evolve(_SharedState(), states=[done]), None, None, 4)


@pytest.mark.parametrize("pipelined", MODES)
def test_a_state_two_requests_get_before_either_commits_fails_both(pipelined):
    """Admitted in one step, neither request had consumed a token, so the
    used-state check passed and both advanced the one state. The second
    now fails at admission naming the skill and the holder, and the holder
    fails too, with no output: a skill that pools its states resets one in
    ``start``, and the holder completed with the tokens it had lost
    (``test_a_pooled_state_reset_in_start_fails_its_holder``)."""
    gate = Gate()
    eng = make_engine(registry=BUILTIN.with_skill(_SharedState()), pipelined=pipelined, gate=gate)
    try:
        gate.arm(at=1)
        blocker = eng.submit("query", question="the sky", max_tokens=4)  # holds the decode thread
        gate.wait_reached()
        first = eng.submit("shared", question="the cat", max_tokens=5)
        second = eng.submit("shared", question="a dog", max_tokens=5)
        gate.open()
        result = second.result(WAIT)
        assert result.status is Status.FAILED and result.output is None and result.tokens == ()
        assert result.finish_reason == ("skill 'shared': decode_state returned the state request "
                                        f"{first.request_id} holds: each request needs a fresh state")
        held = first.result(WAIT)
        assert held.status is Status.FAILED and held.output is None
        assert held.finish_reason == ("skill 'shared': decode_state returned this request's state to "
                                      f"request {second.request_id} too: each request needs a fresh state")
        alone = eng.submit("query", question="the cat", max_tokens=5).result(WAIT)
        assert alone.tokens == reference("query", {"question": "the cat"}, None, 5)  # serving on
        assert blocker.result(WAIT).status is Status.COMPLETED
        wait_idle(eng)
    finally:
        gate.open()
        eng.close()


@attrs.frozen
class _Pooled(Query):
    """Pools one state and resets it in ``start``, as a skill recycling its
    states would."""
    name: str = "pooled"
    states: list = attrs.field(factory=list, eq=False)

    def start(self, tables, args, budget):
        if not self.states:
            self.states.append(TextState(tables))
        state = self.states[0]
        state.tokens.clear()  # the reset: what the holder had advanced is gone
        state.consumed, state.done = 0, False
        return state


@pytest.mark.parametrize("pipelined", MODES)
def test_a_pooled_state_reset_in_start_fails_its_holder(pipelined):
    """The second request's ``start`` reset the state the first, still
    running, held. The core failed the second and let the first complete:
    its output was built from a state that had lost its first tokens, and
    passed as whole. Fixed: the holder fails too, with no output."""
    gate = Gate()
    eng = make_engine(registry=BUILTIN.with_skill(_Pooled()), pipelined=pipelined, gate=gate)
    try:
        gate.arm(at=3)
        first = eng.submit("pooled", question="the sky", max_tokens=6)
        gate.wait_reached()  # it has committed tokens
        second = eng.submit("pooled", question="the sky", max_tokens=6)
        gate.open()
        assert second.result(WAIT).status is Status.FAILED
        held = first.result(WAIT)
        assert held.status is Status.FAILED and held.output is None, (held.status, held.output)
        assert "to request" in held.finish_reason and "too" in held.finish_reason, held.finish_reason
        wait_idle(eng)
    finally:
        gate.open()
        eng.close()
