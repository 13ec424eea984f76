"""The worked example of docs/skills.md: a skill in one file, registered once."""

from __future__ import annotations

import pytest

from bubblefree.core import Engine, SamplingParams
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.skills import (BUILTIN, LocationCodec, SkillError, SkillSet, WordTokenizer, demo_tokenizer,
                    location_tokens)
from bubblefree.skills.driver import MaskRecorder, drive
from bubblefree.skills.yesno import YesNo

TOK = demo_tokenizer(coord_bins=16, size_bins=4)
CODEC_ARGS = {"coord_bins": 16, "size_bins": 4}


def skillset(register, tok=TOK):
    return SkillSet(tok, register, codec=LocationCodec.for_tokenizer(tok, **CODEC_ARGS))


def test_it_is_registered_and_allows_only_yes_and_no_spellings():
    assert isinstance(BUILTIN.get("yesno"), YesNo)
    masks = MaskRecorder()
    req = skillset(masks.register).request("yesno", question="is there a cat")
    assert req.max_tokens == 1
    allowed = masks.allowed(req.decode_state().mask_id())
    assert {TOK.vocab[t] for t in allowed} == {"yes", "no", "Yes", "No"}  # not "no.": exact words only


@pytest.mark.parametrize("word,answer", [("yes", True), ("Yes", True), ("no", False), ("No", False)])
def test_the_committed_spelling_gives_the_answer(word, answer):
    masks = MaskRecorder()
    req = skillset(masks.register).request("yesno", question="is it")
    tokens, out = drive(req, masks, lambda allowed, step: (TOK.vocab.index(word), None))
    assert tokens == (TOK.vocab.index(word),) and out == {"answer": answer}
    assert req.finisher((), None) == {"answer": None}  # cancelled before any token


def test_a_tokenizer_without_yes_cannot_compile_it():
    tok = WordTokenizer.build(("no",) + location_tokens(**CODEC_ARGS))
    with pytest.raises(SkillError, match="yes"):
        skillset(MaskRecorder().register, tok).request("yesno", question="hm")


@pytest.mark.parametrize("pipelined", [True, False])
def test_it_runs_through_the_engine(pipelined):
    yes = TOK.vocab.index("yes")

    def scores(prompt, position, prev):  # "yes" best, but an unconstrained
        out = [0.0] * len(TOK)           # model would say "cat" instead
        out[yes], out[TOK.vocab.index("cat")] = 0.5, 0.9
        return out

    engine = Engine(FakeBackend(model=FakeModel(vocab_size=len(TOK), eos_id=TOK.eos_id,
                                                score_fn=scores)), pipelined=pipelined)
    skills = skillset(engine.register_mask)
    h = engine.submit(skills.request("yesno", question="is there a cat",
                                     sampling=SamplingParams()))
    engine.run_until_idle()
    assert h.result.tokens == (yes,) and h.result.output == {"answer": True}
    assert h.result.finish_reason == "done"
