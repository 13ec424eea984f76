"""A skill author's mistakes, each once a defect of the layer around it: the
author's request fails, naming the skill and the hook, and the engine
serves on. (``test_skills_guards`` holds the decode thread's hooks.)"""

from __future__ import annotations

import asyncio

import attrs
import pytest

from bubblefree import Engine, Status
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import PromptValue, ValueKind
from bubblefree.fake_backend import FakeBackend
from bubblefree.skills import LocationCodec, SkillSet
from bubblefree.skills.base import SkillError
from bubblefree.skills.registry import BUILTIN, Registry
from bubblefree.skills.text import Query
from tests.serving_world import TOK, WAIT, Gate, endless_model, make_engine, wait_idle

MODES = [True, False, "auto"]


def _with(*skills, **kw):
    return make_engine(registry=BUILTIN.with_skill(*skills), **kw)


def _serves(eng) -> None:
    assert eng.submit("query", question="the cat", max_tokens=3).result(WAIT).status is Status.COMPLETED


@attrs.frozen
class _AwaitsInFinish(Query):
    """``finish`` waits on the engine through asyncio, on the decode thread."""
    name: str = "awaits"
    engines: list = attrs.field(factory=list, eq=False)
    call: str = "arun"

    def finish(self, state):
        eng = self.engines[0]

        async def wait():
            if self.call == "arun":
                return await eng.arun("query", question="the dog", max_tokens=2)
            if self.call == "astream":
                return [p async for p in eng.astream("query", question="the dog", max_tokens=2)]
            return await eng.astream_now("query", question="the dog", max_tokens=2)
        return asyncio.run(wait())


@pytest.mark.parametrize("call", ["arun", "astream", "astream_now"])
def test_an_asyncio_wait_in_a_hook_fails_its_request_not_the_engine(call):
    """``asyncio.run(engine.arun(...))`` in a hook: the decode thread
    waited for itself, every request stopped and ``close`` could not end
    the thread. The blocking calls were refused there; the asyncio ones
    now are too."""
    skill = _AwaitsInFinish(call=call)
    eng = _with(skill)
    skill.engines.append(eng)
    try:
        result = eng.submit("awaits", question="the cat", max_tokens=3).result(WAIT)
        assert result.status is Status.FAILED
        assert "raised RuntimeError in finish" in result.finish_reason, result.finish_reason
        assert "on the decode thread" in result.finish_reason
        _serves(eng)
        wait_idle(eng)
    finally:
        eng.close()


def _core():
    return CoreEngine(FakeBackend(model=endless_model(), num_pages=64, max_rows=4, max_seqs=8))


def test_a_skill_set_compiled_for_another_core_is_refused():
    """Its masks were registered on the first core and compile no more: the
    second engine failed every constrained request on an unknown mask id."""
    first, second = _core(), _core()
    skills = SkillSet(TOK, first.register_mask, codec=LocationCodec.for_tokenizer(TOK, coord_bins=64, size_bins=16))
    eng = Engine(first, skills)
    try:
        with pytest.raises(ValueError, match="skills: compiled for another engine's core"):
            Engine(second, skills)
        _serves(eng)
    finally:
        eng.close()


@attrs.frozen
class _Raises(Query):
    """Raises ``error`` from the hook named ``hook``."""
    name: str = "raises"
    hook: str = "start"
    error: BaseException = attrs.field(factory=lambda: asyncio.CancelledError("bug"), eq=False)

    def _maybe(self, hook):
        if hook == self.hook:
            raise self.error

    def parse_args(self, args):
        self._maybe("parse_args")
        return super().parse_args(args)

    def prompt(self, tokenizer, args):
        self._maybe("prompt")
        return super().prompt(tokenizer, args)

    def start(self, tables, args, budget):
        self._maybe("start")
        return super().start(tables, args, budget)


@pytest.mark.parametrize("error", [asyncio.CancelledError("bug"), GeneratorExit("bug"), ValueError("bug")],
                         ids=lambda e: type(e).__name__)
def test_a_request_cancelled_while_queued_stays_cancelled_whatever_start_raises(error):
    """Its ``start`` raising ``CancelledError`` (or ``GeneratorExit``) made
    it fail, blamed on ``finish``; a ``ValueError`` already left it
    cancelled, as the docs promise for any exception."""
    gate = Gate()
    eng = _with(_Raises(error=error), gate=gate, max_seqs=1)
    try:
        gate.arm()
        blocker = eng.submit("query", question="the sky", max_tokens=4)  # the one sequence slot
        gate.wait_reached()
        queued = eng.submit("raises", question="the cat", max_tokens=4)
        queued.cancel()
        gate.open()
        result = queued.result(WAIT)
        assert (result.status, result.output) == (Status.CANCELLED, None), result.finish_reason
        assert blocker.result(WAIT).status is Status.COMPLETED
        wait_idle(eng)
    finally:
        gate.open()
        eng.close()


@pytest.mark.parametrize("hook", ["parse_args", "prompt"])
@pytest.mark.parametrize("error", [asyncio.CancelledError("bug"), GeneratorExit("bug")],
                         ids=lambda e: type(e).__name__)
def test_a_submit_hook_raising_cancelled_error_is_named(hook, error):
    """It escaped bare: under asyncio the caller's task looked cancelled."""
    eng = _with(_Raises(hook=hook, error=error))
    try:
        with pytest.raises(SkillError, match=f"skill 'raises' raised {type(error).__name__} in {hook}: bug"):
            eng.submit("raises", question="the cat", max_tokens=3)
        _serves(eng)
    finally:
        eng.close()


def test_a_skill_error_a_submit_hook_raises_names_the_skill_and_hook():
    """It passed bare (``SkillError: bad token table``)."""
    eng = _with(_Raises(hook="prompt", error=SkillError("bad token table")))
    try:
        with pytest.raises(SkillError, match=r"^skill 'raises' raised SkillError in prompt: bad token table$"):
            eng.submit("raises", question="the cat", max_tokens=3)
    finally:
        eng.close()


@attrs.frozen
class _Prompts(Query):
    """Returns ``ids`` as its prompt, ``values`` as its prompt values."""
    name: str = "prompts"
    ids: tuple = None
    values: tuple = ()

    def prompt(self, tokenizer, args):
        return super().prompt(tokenizer, args) if self.ids is None else list(self.ids)

    def prompt_values(self, tokenizer, args):
        return self.values


@pytest.mark.parametrize("skill, match", [
    (_Prompts(ids=()), r"skill 'prompts': prompt\(\) returned no token"),
    (_Prompts(values=(1, 2)), r"skill 'prompts': prompt_values\(\) returned a bad value: entry 0 must be a "
                              r"PromptValue, got int"),
    (_Prompts(values=(PromptValue(10 ** 6, ValueKind.COORD, 0.5),)),
     r"skill 'prompts': prompt_values\(\) returned a bad value: entry 0: index 1000000"),
])
def test_what_a_submit_hook_returns_wrong_is_the_skills_bug_not_the_callers(skill, match):
    """An empty prompt was refused as the caller's ``prompt``; bad prompt
    values as ``spatial_refs`` or ``prompt_values``, fields this caller
    never sent, naming no skill."""
    eng = _with(skill)
    try:
        with pytest.raises(SkillError, match=match):
            eng.submit("prompts", question="the cat", max_tokens=3)
        _serves(eng)
    finally:
        eng.close()


def test_prompt_values_without_an_image_are_the_skills_bug_unless_the_caller_sent_refs():
    eng = _with(_Prompts(values=(PromptValue(0, ValueKind.COORD, 0.5),)))
    try:
        with pytest.raises(SkillError, match=r"prompt_values\(\) returned values, which refer to an image, "
                                             r"for a request without one"):
            eng.submit("prompts", question="the cat", max_tokens=3)
    finally:
        eng.close()


@pytest.mark.parametrize("name", ["\ud800", " query2", "x" * 65, "a\nb", "", 3])
def test_a_skill_name_a_refusal_could_not_print_is_refused_at_registration(name):
    """A lone surrogate was accepted, and every unknown-skill refusal then
    quoted it: printing one raised ``UnicodeEncodeError``."""
    with pytest.raises(ValueError, match="a skill's name must be") as err:
        BUILTIN.with_skill(_Prompts(name=name))
    str(err.value).encode("utf-8")  # printable
    with pytest.raises(ValueError, match="a skill is registered under its name"):
        Registry({name: _Prompts(name=name)})


def test_an_object_that_is_not_a_skill_is_refused_at_registration():
    """It was taken, and the engine's build failed on a hook it lacked,
    with a bare ``AttributeError``."""
    class NotASkill:
        name = "fake"

    with pytest.raises(ValueError, match="a skill must be a Skill"):
        BUILTIN.with_skill(NotASkill())


@attrs.frozen
class _MasksPerRequest(Query):
    """Keeps the compile context and registers a mask for each request in
    ``start``, from the caller's words."""
    name: str = "per_request"
    ctx: list = attrs.field(factory=list, eq=False)

    def compile(self, ctx):
        self.ctx.append(ctx)
        return super().compile(ctx)

    def start(self, tables, args, budget):
        self.ctx[0].mask(frozenset({1, 2, 3 + len(args.question)}))
        return super().start(tables, args, budget)


def test_a_mask_registered_after_the_skills_compiled_fails_its_request():
    """It was taken: masks registered on the decode thread mid-tick, one a
    request, never freed (300 requests, 300 masks)."""
    eng = _with(_MasksPerRequest())
    try:
        before = len(eng.core.masks)
        result = eng.submit("per_request", question="the cat", max_tokens=3).result(WAIT)
        assert result.status is Status.FAILED
        assert "a mask is registered only while the skills compile" in result.finish_reason
        assert len(eng.core.masks) == before
        _serves(eng)
    finally:
        eng.close()


@attrs.frozen
class _OwnMask(Query):
    """Compiles a mask no other skill has."""
    name: str = "own_mask"

    def compile(self, ctx):
        ctx.mask(frozenset({1, 2, 5}))
        return super().compile(ctx)


def test_a_skill_swapped_into_a_compiled_set_cannot_register_masks():
    """``engine.skills.registry = ...with_skill(Late())`` compiled the new
    skill on the caller's thread while the decode thread served, its masks
    registered from there. (One whose sets are all registered already
    compiles: nothing new reaches the core.)"""
    eng = _with()
    try:
        before = len(eng.core.masks)
        eng.skills.registry = eng.skills.registry.with_skill(_OwnMask(name="late"))
        with pytest.raises(SkillError, match="skill 'late' cannot compile: .*registered only while"):
            eng.submit("late", question="the cat", max_tokens=3)
        assert len(eng.core.masks) == before
        _serves(eng)
    finally:
        eng.close()
