"""Free text: query and caption never sample a location; streaming deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from bubblefree.skills import HFTokenizer, SkillSet, TextStream, demo_tokenizer
from bubblefree.skills.driver import MaskRecorder, drive

TOK = demo_tokenizer()
MASKS = MaskRecorder()
SKILLS = SkillSet(TOK, MASKS.register)


def test_answers_and_captions_decode_the_text_before_eos():
    words = iter(["a", "cat", "on", "the", "mat", "<eos>"])
    req = SKILLS.request("query", question="what is it")
    tokens, out = drive(req, MASKS, lambda allowed, step: (TOK.vocab.index(next(words)), None))
    assert out == {"answer": "a cat on the mat"} and tokens[-1] == TOK.eos_id
    req = SKILLS.request("caption", length="long", max_tokens=3)
    tokens, out = drive(req, MASKS, lambda allowed, step: (TOK.vocab.index("cat"), None))
    assert out == {"caption": "cat cat cat"}  # cut by the budget: text has no objects to break


@settings(deadline=None)
@given(st.lists(st.sampled_from(range(2, 60)), max_size=20))
def test_streamed_deltas_add_up_to_the_text(ids):
    stream = TextStream(TOK, frozenset({TOK.eos_id}))
    pieces = [stream.push([t]) for t in ids] + [stream.push([TOK.eos_id])]
    assert "".join(pieces) == TOK.decode(ids)


def test_streaming_holds_back_half_a_character():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers

    raw = Raw(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())},
                         merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(["<eos>"])
    tok = HFTokenizer.wrap(transformers.PreTrainedTokenizerFast(tokenizer_object=raw,
                                                                eos_token="<eos>"))
    ids = tok.encode("café 🐱!")  # one token per byte: the emoji takes four
    stream = TextStream(tok)
    pieces = [stream.push([t]) for t in ids]
    assert "".join(pieces) == "café 🐱!"
    assert not any("\ufffd" in p for p in pieces)
