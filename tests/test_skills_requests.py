"""Building requests: argument validation (each error names its field),
prompts, budgets, compile-once, the registry, and the transformers adapter."""

from __future__ import annotations

import pytest

from bubblefree.core.decode_state import DecodeState
from bubblefree.core.values import InvalidRequest, Request, SamplingParams
from bubblefree.skills import (BUILTIN, HFTokenizer, Kind, LocationCodec, SkillSet, Tokenizer,
                    build_request, demo_tokenizer, location_tokens)
from bubblefree.skills.driver import MaskRecorder, drive
from bubblefree.skills.point import Point
from small_tokenizer import small_bpe_tokenizer

TOK = demo_tokenizer()
MASKS = MaskRecorder()
SKILLS = SkillSet(TOK, MASKS.register)

BAD = [
    ("nope", {}, "skill"),
    (None, {}, "skill"),
    ("query", {}, "question"),
    ("query", {"question": "   "}, "question"),
    ("query", {"question": 3}, "question"),
    ("query", {"question": "hi", "object": "cat"}, "object"),
    ("caption", {"length": "huge"}, "length"),
    ("caption", {"length": None}, "length"),
    ("point", {"object": ""}, "object"),
    ("point", {}, "object"),
    ("point", {"object": "cat", "max_objects": 0}, "max_objects"),
    ("detect", {"object": "cat", "max_objects": -2}, "max_objects"),
    ("detect", {"object": "cat", "max_objects": 1.5}, "max_objects"),
    ("detect", {"object": "cat", "max_objects": True}, "max_objects"),
    ("segment", {"object": ""}, "object"),
    ("complete", {}, "prompt"),
    ("complete", {"prompt": []}, "prompt"),
    ("complete", {"prompt": [1, True]}, "prompt"),
    ("complete", {"prompt": [1.5]}, "prompt"),
    ("complete", {"prompt": "  "}, "prompt"),
    ("complete", {"prompt": "hi \ud800"}, "prompt"),
    ("complete", {"prompt": "hi", "question": "x"}, "question"),
    ("segment", {"object": "cat", "max_objects": 3}, "max_objects"),
    ("yesno", {"question": ""}, "question"),
    ("point", {"object": "cat", "max_tokens": 0}, "max_tokens"),
    ("point", {"object": "cat", "max_tokens": "8"}, "max_tokens"),
    ("query", {"question": "what " * 50, "max_context": 40}, "prompt"),
    ("query", {"question": "hi", "max_tokens": 100, "max_context": 40}, "max_tokens"),
]


@pytest.mark.parametrize("name,args,field", BAD)
def test_bad_input_raises_invalid_request_naming_the_field(name, args, field):
    with pytest.raises(InvalidRequest) as err:
        SKILLS.request(name, **args)
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_requests_carry_prompt_budget_and_skill_hooks():
    req = build_request(SKILLS, "detect", object="cat", max_objects=3,
                        sampling=SamplingParams(temperature=0.5, seed=7), tag="t")
    assert isinstance(req, Request)
    assert TOK.decode(req.prompt) == "Detect: cat"
    assert req.max_tokens == 13 and req.stop_ids == {TOK.eos_id}  # 3 boxes of 4, then EOS
    assert req.sampling.seed == 7 and req.tag == "t"
    assert req.decode_state() is not req.decode_state()  # a fresh state per admission
    assert SKILLS.request("point", object="cat", max_objects=4).max_tokens == 9
    assert SKILLS.request("caption", length="long").max_tokens == 768
    assert TOK.decode(SKILLS.request("caption").prompt) == "Describe this image."
    assert "Question: is there a cat" in TOK.decode(SKILLS.request("yesno", question="is there a cat").prompt)
    assert SKILLS.request("query", question="hi", max_context=40, max_tokens=30).max_tokens == 30


@pytest.mark.parametrize("name,args", [
    ("query", {"question": "hi"}), ("caption", {}), ("point", {"object": "cat"}),
    ("detect", {"object": "cat"}), ("segment", {"object": "cat"}), ("yesno", {"question": "hi"})])
def test_every_skill_state_is_a_core_decode_state(name, args):
    req = SKILLS.request(name, **args)
    state = req.decode_state()
    assert isinstance(state, DecodeState)
    assert isinstance(state.mask_id(), int)  # every built-in state constrains something
    assert req.finisher((), state) == req.finisher((), None)


def test_compiling_is_lazy_cached_and_registers_each_set_once():
    masks = MaskRecorder()
    skills = SkillSet(TOK, masks.register)
    assert masks.masks == []
    skills.request("point", object="cat")
    after_point = len(masks.masks)
    skills.request("point", object="dog", max_objects=2)
    skills.request("detect", object="dog")  # shares the x (+EOS) and y sets with point
    assert len(masks.masks) == after_point + 1  # only the size set is new
    skills.compile_all()
    assert len(set(masks.masks)) == len(masks.masks) == skills.num_masks
    assert skills.tables("segment") is skills.tables("segment")


def test_without_a_spatial_codec_only_the_text_skills_serve():
    masks = MaskRecorder()
    skills = SkillSet(TOK, masks.register, codec=None).compile_all()
    assert {n for n in BUILTIN.names if skills.serves(n)} == {"query", "caption", "yesno", "complete"}
    for name in ("point", "detect", "segment"):
        with pytest.raises(InvalidRequest, match=f"^skill: .*no location tokens.*'{name}'"):
            skills.request(name, object="cat")
        with pytest.raises(InvalidRequest, match="no location tokens"):
            skills.tables(name)
    before = list(masks.masks)
    query = skills.request("query", question="what is the cat?")
    assert masks.masks == before  # compile_all compiled the text skills, and nothing spatial
    # With no spatial tokens, free text may use every id.
    assert masks.allowed(skills.tables("query").mask) == frozenset(range(len(TOK)))
    tokens, output = drive(query, masks, lambda allowed, step: (TOK.eos_id, None))
    assert output == {"answer": ""}
    assert skills.request("yesno", question="is it a cat?").max_tokens >= 1


def test_the_default_codec_needs_the_location_tokens():
    from bubblefree.skills import WordTokenizer
    from bubblefree.skills.codec import CodecError

    with pytest.raises(CodecError, match="location tokens"):
        SkillSet(WordTokenizer.build(["a", "b"]), MaskRecorder().register)


def test_a_registry_takes_new_skills_without_changing_the_old():
    with pytest.raises(ValueError, match="already registered"):
        BUILTIN.with_skill(Point())
    custom = BUILTIN.with_skill(Point(name="point2"))
    assert "point2" in custom.names and "point2" not in BUILTIN.names
    skills = SkillSet(TOK, MaskRecorder().register, registry=custom)
    assert skills.request("point2", object="cat").max_tokens == 101


def _hf_tokenizer():
    pytest.importorskip("transformers")
    return small_bpe_tokenizer()


def test_a_transformers_tokenizer_works_through_the_adapter():
    hf = _hf_tokenizer()
    before = len(hf)
    tok = HFTokenizer.wrap(hf, add_tokens=location_tokens(16, 8))
    assert isinstance(tok, Tokenizer)
    assert len(tok) == before + 24 == len(tok.vocab) and tok.added == location_tokens(16, 8)
    assert tok.vocab[tok.eos_id] == "<|endoftext|>"
    assert " M" in tok.vocab  # byte-level "ĠM", as the text it adds
    assert tok.decode(tok.encode("what is the cat?")) == "what is the cat?"
    codec = LocationCodec.for_tokenizer(tok, coord_bins=16, size_bins=8)
    assert tok.vocab[codec.encode(Kind.X, 1.0)] == "<loc_15>"
    assert HFTokenizer.wrap(hf, add_tokens=location_tokens(16, 8)).added == ()  # idempotent

    masks = MaskRecorder()
    skills = SkillSet(tok, masks.register, codec=codec).compile_all()
    path_start = masks.allowed(skills.tables("segment").path.masks[0])
    assert {tok.vocab[t] for t in path_start} >= {"M", " M"}
    # Free text never yields a location token, and its decode hides specials.
    text = masks.allowed(skills.tables("query").mask)
    assert not text & codec.spatial_ids()
    loc = codec.encode(Kind.X, 0.5)
    assert tok.decode([loc] + tok.encode(" cat")) == " cat"

    # A point call, end to end on the engine-free driver.
    req = skills.request("point", object="cat", max_objects=1)
    tokens, out = drive(req, masks, lambda allowed, step: (min(allowed - {tok.eos_id}), None))
    assert out == {"points": [{"x": 1 / 32, "y": 1 / 32}]}


def test_a_tokenizer_without_eos_is_refused():
    hf = _hf_tokenizer()
    hf.eos_token = None
    with pytest.raises(ValueError, match="eos"):
        HFTokenizer.wrap(hf)


def test_complete_takes_a_framed_prompt_as_text_or_ids_and_is_bounded_like_the_others():
    ids = TOK.encode("the cat sat")
    as_ids = SKILLS.request("complete", prompt=ids)
    as_text = SKILLS.request("complete", prompt="the cat sat")
    assert as_ids.prompt == as_text.prompt == tuple(ids) and as_ids.skill == "complete"
    # The default is cut to the model's room; a max_tokens given that does not fit is named.
    assert SKILLS.request("complete", prompt=ids, max_context=len(ids) + 7).max_tokens == 7
    with pytest.raises(InvalidRequest, match="^max_tokens"):
        SKILLS.request("complete", prompt=ids, max_tokens=8, max_context=len(ids) + 7)
