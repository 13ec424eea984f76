"""Skills as users write and call them, at their edges: custom skills
whose state is malformed, a registry with names that are not strings,
skills that cannot compile, detect's budget on a region head, and segment's
smallest budget."""

from __future__ import annotations

import attrs
import pytest

from bubblefree import Engine, InvalidRequest, Status
from bubblefree.core import Engine as CoreEngine
from bubblefree.fake_backend import FakeBackend
from bubblefree.skills import LocationCodec, RegionHeadCodec, SkillSet
from bubblefree.skills.base import SkillError
from bubblefree.skills.driver import MaskRecorder
from bubblefree.skills.registry import BUILTIN, Registry
from bubblefree.skills.spatial_refs import spatial_refs_arg
from bubblefree.skills.text import Query, TextState
from tests.serving_world import TOK, WAIT, Unprintable, endless_model, make_engine, reference


# -- custom skills whose state is not a proper DecodeState --------------------

class _NoMaskId:
    """What a user might return from ``start``: forgot to subclass SkillState."""
    consumed = 0
    done = False

    def advance(self, token, value=None):
        return False


class _NoAdvance:
    """A state with ``mask_id`` but no ``advance`` (typo'd as ``_step`` only, say)."""
    consumed = 0
    done = False

    def __init__(self, mask):
        self.mask = mask

    def mask_id(self):
        return self.mask


class _RaisingValueKind(TextState):
    """``value_kind`` written as a property that raises (any non-AttributeError)."""

    @property
    def value_kind(self):
        raise ValueError("no region head here")


class _RaisingMidway(TextState):
    """``advance`` raising at the third token what ``raising`` makes."""
    raising: type = Unprintable

    def advance(self, token, value=None):
        if self.consumed >= 2:
            raise self.raising()
        return super().advance(token, value)


class _Cancelled(_RaisingMidway):
    """asyncio's CancelledError, a BaseException, from a skill's bug."""
    import asyncio
    raising = asyncio.CancelledError


class _ArrayAnswer(TextState):
    """``advance`` answering with what has no truth value (a numpy array)."""

    def advance(self, token, value=None):
        import numpy as np
        return np.array([super().advance(token, value), False])


class _MaskGeneratorExit(TextState):
    def mask_id(self):
        raise GeneratorExit


def _state_skill(name: str, state: type):
    @attrs.frozen
    class _Skill(Query):
        def start(self, tables, args, budget):
            return state(tables)
    return _Skill(name=name)


@attrs.frozen
class _NoMaskIdSkill(Query):
    name: str = "no_mask_id"

    def start(self, tables, args, budget):
        return _NoMaskId()


@attrs.frozen
class _NoAdvanceSkill(Query):
    name: str = "no_advance"

    def start(self, tables, args, budget):
        return _NoAdvance(tables.mask)


@attrs.frozen
class _RaisingValueKindSkill(Query):
    name: str = "raising_value_kind"

    def start(self, tables, args, budget):
        return _RaisingValueKind(tables)


@attrs.frozen
class _StartReturnsNone(Query):
    name: str = "start_none"

    def start(self, tables, args, budget):
        return None


BROKEN = BUILTIN.with_skill(_NoMaskIdSkill(), _NoAdvanceSkill(), _RaisingValueKindSkill(), _StartReturnsNone(),
                            _state_skill("unprintable", _RaisingMidway),
                            _state_skill("cancelled", _Cancelled),
                            _state_skill("array_answer", _ArrayAnswer),
                            _state_skill("mask_generator_exit", _MaskGeneratorExit))


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("skill", ["no_mask_id", "no_advance", "raising_value_kind", "unprintable",
                                   "cancelled", "array_answer", "mask_generator_exit"])
def test_a_custom_skill_with_a_malformed_state_fails_only_its_own_request(skill, pipelined):
    """A state without ``mask_id`` or ``advance``, or whose ``value_kind``
    property raises: the lookups happen under the guard, so the request
    fails naming its skill and the others are served (the engine stopped).
    So too, and they stopped it until an audit: an exception whose message
    raises, a BaseException that is not an Exception (CancelledError,
    GeneratorExit), and ``advance`` answering with what has no truth value."""
    eng = make_engine(registry=BROKEN, pipelined=pipelined)
    try:
        good, bad = eng.submit_many([("query", dict(question="the cat", max_tokens=8)),
                                     (skill, dict(question="a dog", max_tokens=8))])
        bad_result = bad.result(WAIT)
        assert bad_result.status is Status.FAILED
        assert f"skill {skill!r}" in bad_result.finish_reason, bad_result.finish_reason
        assert good.result(WAIT).tokens == reference("query", {"question": "the cat"}, None, 8)
        assert eng.loop.running, f"the engine stopped serving: {eng.loop._error!r}"
        assert eng.submit("query", question="is there a cat", max_tokens=4).result(WAIT).status is Status.COMPLETED
    finally:
        eng.close()


def test_a_start_that_returns_no_state_is_refused_at_admission_not_run_unconstrained():
    """A ``start`` that returns None (a forgotten ``return``) fails the
    request at admission, naming the skill and ``start()``, before any token:
    a None state is a plain request's, which would run unconstrained."""
    eng = make_engine(registry=BROKEN)
    try:
        result = eng.submit("start_none", question="the cat", max_tokens=40).result(WAIT)
        assert result.status is Status.FAILED
        assert "start" in result.finish_reason and "consumed" not in result.finish_reason, result.finish_reason
        assert result.tokens == (), f"ran {len(result.tokens)} unconstrained tokens before failing"
    finally:
        eng.close()


# -- the registry ------------------------------------------------------------

def test_a_skill_with_a_non_string_name_is_refused_when_registered():
    """A skill named by a non-str (which no request could name) is refused."""
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        BUILTIN.with_skill(Query(name=5))


def test_an_unknown_skill_is_named_even_in_a_registry_holding_a_non_string_name():
    """A registry is refused up front if a key is not its skill's str name;
    were one held, an unknown skill would still be named as such."""
    with pytest.raises(ValueError, match="registered under its name"):
        Registry({"query": Query(), 5: Query(name=5)})
    with pytest.raises(ValueError, match="registered under its name"):
        Registry({"query": Query(), "ask": Query()})  # a key that is not the skill's name
    with pytest.raises(InvalidRequest, match="^skill: unknown skill 'qeury'"):
        BUILTIN.get("qeury")


# -- compile errors name nothing ---------------------------------------------

@attrs.frozen
class _OutOfVocabMask(Query):
    name: str = "out_of_vocab"

    def compile(self, ctx):
        return attrs.evolve(super().compile(ctx), mask=ctx.mask(frozenset({len(ctx.tokenizer) + 5})))


@attrs.frozen
class _EmptyMask(Query):
    name: str = "empty_mask"

    def compile(self, ctx):
        return attrs.evolve(super().compile(ctx), mask=ctx.mask(frozenset()))


@attrs.frozen
class _CompileBug(Query):
    name: str = "compile_bug"

    def compile(self, ctx):
        return {}["yes"]  # a KeyError: the skill's own bug, not a ValueError


@pytest.mark.parametrize("skill", [_OutOfVocabMask(), _EmptyMask(), _CompileBug()], ids=lambda s: s.name)
def test_a_custom_skill_that_cannot_compile_is_named_in_the_error(skill):
    """An empty or out-of-vocabulary mask: the build's error names the skill
    (and the ids outside), so a deployment with several can tell which. Any
    exception of its compile is named so (a KeyError was raised bare)."""
    core = CoreEngine(FakeBackend(model=endless_model(), num_pages=64))
    skills = SkillSet(TOK, core.register_mask, registry=BUILTIN.with_skill(skill),
                      codec=LocationCodec.for_tokenizer(TOK, coord_bins=64, size_bins=16))
    with pytest.raises(SkillError, match=f"^skill '{skill.name}' cannot compile: ") as err:
        skills.compile_all()
    if skill.name == "out_of_vocab":
        assert f"{len(TOK) + 5}" in str(err.value)


# -- max_objects on a region head ---------------------------------------------

def test_detect_max_objects_that_fit_on_a_region_head_are_not_refused():
    """On a region head a box is 3 tokens (x, y, one size), so 5 boxes need
    16 and fit a room of 18 (budgeted at the location tokens' 4, they were
    refused: "5 objects need up to 21 tokens")."""
    core = CoreEngine(FakeBackend(model=endless_model(), num_pages=64, max_context=20), pipelined=True)
    skills = SkillSet(TOK, core.register_mask, codec=RegionHeadCodec.for_tokenizer(TOK)).compile_all()
    eng = Engine(core, skills)
    try:
        prompt = len(skills.request("detect", object="cat", max_tokens=1).prompt)
        assert 20 - prompt >= 3 * 5 + 1  # the room really holds five boxes and an EOS
        result = eng.submit("detect", object="cat", max_objects=5).result(WAIT)
        assert result.status is Status.COMPLETED
        assert len(result.output["objects"]) == 5
    finally:
        eng.close()


# -- segment's minimum budget ---------------------------------------------------

@pytest.mark.parametrize("pipelined", [True, False])
def test_segment_only_starts_an_outline_when_a_bbox_and_a_whole_move_fit(pipelined):
    """A found bbox always comes with an outline: the path grammar allows a
    space before ``M``, counted in the least budget worth starting (at 7
    tokens the answer was a bbox and an empty path)."""
    eng = make_engine(pipelined=pipelined)
    try:
        result = eng.submit("segment", object="cat", max_tokens=7).result(WAIT)
        assert result.status is Status.COMPLETED
        out = result.output
        words = [TOK.vocab[t] for t in result.tokens]
        assert out["bbox"] is None or out["path"].startswith("M "), (words, out)
    finally:
        eng.close()


# -- user text that spells special tokens ---------------------------------------

@pytest.fixture(scope="module")
def bpe():
    from bubblefree.skills import HFTokenizer, location_tokens
    from tests.small_tokenizer import small_bpe_tokenizer

    tok = HFTokenizer.wrap(small_bpe_tokenizer(), add_tokens=location_tokens(16, 8))
    return tok, SkillSet(tok, MaskRecorder().register, codec=LocationCodec.for_tokenizer(tok, coord_bins=16,
                                                                                         size_bins=8))


@pytest.mark.parametrize("skill,args,token", [
    ("query", {"question": "what is <|endoftext|> here"}, "<|endoftext|>"),
    ("point", {"object": "cat <loc_3> <loc_4>"}, "<loc_3>"),
    ("detect", {"object": "<size_2>"}, "<size_2>"),
])
def test_user_text_spelling_a_special_token_is_refused_naming_it(bpe, skill, args, token):
    """The tokenizer would read it as that token: a question could end the
    turn, an object hand point ready-made coordinates."""
    tok, skills = bpe
    with pytest.raises(InvalidRequest, match=f"^prompt: spells the model's special token '{token}'"):
        skills.request(skill, **args)
    assert tok.eos_id not in skills.request("query", question="what is < |endoftext| > here").prompt


def test_a_chat_turn_spelling_a_special_token_is_refused(bpe):
    from bubblefree.server.runs import chat_prompt

    tok, _ = bpe
    with pytest.raises(InvalidRequest, match="^prompt: spells the model's special token '<|endoftext|>'"):
        chat_prompt(tok, [("user", "hi"), ("assistant", "<|endoftext|>"), ("user", "and?")])
    assert chat_prompt(tok, [("user", "hi")])


# -- a skill's hooks at submit, and its tables ----------------------------------

@attrs.frozen
class _Counted(Query):
    """A skill without tables (its states run unmasked), counting compiles."""
    name: str = "counted"
    compiles: list = attrs.field(factory=list, eq=False)

    def compile(self, ctx):
        self.compiles.append(1)


def test_a_skill_whose_tables_are_none_compiles_once():
    """None was the mark of "not compiled yet": such a skill compiled again
    at every request, walking the vocabulary each time."""
    skill = _Counted()
    eng = make_engine(registry=BUILTIN.with_skill(skill))
    try:
        for _ in range(3):
            eng.submit("counted", question="the cat", max_tokens=3).result(WAIT)
        assert len(skill.compiles) == 1
    finally:
        eng.close()


@attrs.frozen
class _HookBug(Query):
    """One submit-time hook with a bug (a KeyError), or a bad budget."""
    name: str = "hook_bug"
    hook: str = "parse_args"
    budget_answer: object = 5

    def parse_args(self, args):
        if self.hook == "parse_args":
            return {}["question"]
        return super().parse_args(args)

    def prompt(self, tokenizer, parsed):
        if self.hook == "prompt":
            return {}["template"]
        return super().prompt(tokenizer, parsed)

    def budget(self, tables, parsed):
        return self.budget_answer


@pytest.mark.parametrize("hook", ["parse_args", "prompt"])
def test_a_bug_in_a_skills_submit_hook_is_named_with_the_skill_and_the_hook(hook):
    """A KeyError in ``parse_args`` or ``prompt`` reached the caller bare,
    naming neither the skill nor where; the engine serves on."""
    eng = make_engine(registry=BUILTIN.with_skill(_HookBug(hook=hook)))
    try:
        with pytest.raises(SkillError, match=f"^skill 'hook_bug' raised KeyError in {hook}: "):
            eng.submit("hook_bug", question="the cat")
        assert eng.submit("query", question="the cat", max_tokens=3).result(WAIT).status is Status.COMPLETED
    finally:
        eng.close()


@pytest.mark.parametrize("answer", [0, -3, 5.0, None, "5", True])
def test_a_budget_that_is_not_a_count_is_named_as_the_skills(answer):
    """``budget()`` returning 0 was refused as the caller's ``max_tokens``
    (a field the caller never gave), None or "5" as a bare TypeError."""
    eng = make_engine(registry=BUILTIN.with_skill(_HookBug(hook="", budget_answer=answer)))
    try:
        with pytest.raises(SkillError, match=r"^skill 'hook_bug': budget\(\) returned .*, not an integer >= 1"):
            eng.submit("hook_bug", question="the cat")
        assert eng.submit("hook_bug", question="the cat", max_tokens=3).result(WAIT).status \
            is Status.COMPLETED  # the caller's own max_tokens needs no budget
    finally:
        eng.close()


class _Bare:
    """The core's protocol only: ``mask_id`` and ``advance``, no ``consumed``
    nor ``done``, which the finisher reads."""

    def mask_id(self):
        return None

    def advance(self, token, value=None):
        return False


class _FailsMidway(TextState):
    def advance(self, token, value=None):
        if self.consumed >= 2:
            raise ValueError("table miss")
        return super().advance(token, value)


def test_a_state_without_what_the_finisher_reads_is_refused_at_admission():
    """It ran its whole budget, then failed in finish."""
    eng = make_engine(registry=BUILTIN.with_skill(_state_skill("bare", lambda tables: _Bare())))
    try:
        result = eng.submit("bare", question="the cat", max_tokens=30).result(WAIT)
        assert result.status is Status.FAILED and result.tokens == ()
        assert "without consumed or done" in result.finish_reason, result.finish_reason
    finally:
        eng.close()


def test_a_failure_in_advance_keeps_its_reason_and_the_output_so_far():
    """The finisher replayed the refused token, raised again, and the
    reason then blamed ``finish`` with no output."""
    eng = make_engine(registry=BUILTIN.with_skill(_state_skill("midway", _FailsMidway)))
    try:
        result = eng.submit("midway", question="the cat", max_tokens=30).result(WAIT)
        assert result.status is Status.FAILED
        assert "raised ValueError in advance: table miss" in result.finish_reason, result.finish_reason
        assert result.output is not None and result.output["answer"]
    finally:
        eng.close()


@attrs.frozen
class _NumpyIds(Query):
    """Token ids and mask ids as numpy integers, as a skill computing its
    sets with numpy would hand them over."""
    name: str = "numpy_ids"

    def compile(self, ctx):
        import numpy as np
        return attrs.evolve(super().compile(ctx), mask=ctx.mask(set(np.arange(5, 9))))

    def start(self, tables, args, budget):
        return _NumpyMaskState(tables)


class _NumpyMaskState(TextState):
    def mask_id(self):
        import numpy as np
        return np.int64(self.tables.mask)


def test_numpy_integers_serve_as_token_ids_and_mask_ids():
    """Refused with messages that named the ids as outside the vocabulary,
    and a registered mask id as not registered."""
    eng = make_engine(registry=BUILTIN.with_skill(_NumpyIds()))
    try:
        result = eng.submit("numpy_ids", question="the cat", max_tokens=6).result(WAIT)
        assert result.status is Status.COMPLETED, result.finish_reason
        assert set(result.tokens) <= {5, 6, 7, 8}
    finally:
        eng.close()


@pytest.mark.parametrize("skill,refuse,field", [
    ("caption", lambda: BUILTIN.get("caption").parse_args({"length": "x" * 1_000_000}), "length"),
    ("query", lambda: spatial_refs_arg("query", {"spatial_refs": [[0.5] * 300_000]}), "spatial_refs[0]"),
    ("query", lambda: BUILTIN.get("query").parse_args({"question": "why", "colour" * 200_000: 1}),
     "colour" * 16),
], ids=["caption-length", "spatial-refs", "unknown-argument"])
def test_a_refusal_of_a_huge_value_quotes_only_its_start(skill, refuse, field):
    """A refusal quoted the whole bad value: a 1 MB ``length`` came back as a
    1 MB error, a 300,000-number box as 1.5 MB, to every client that sent
    one. The field is still named first and the skill last."""
    with pytest.raises(InvalidRequest) as err:
        refuse()
    message = str(err.value)
    assert message.startswith(field) and message.endswith(f"(skill {skill!r})"), message[:200]
    assert len(message) < 500, len(message)
