"""Which paths are moondream2 checkpoints, and its tokenizer as the skills
see it (``bubblefree.checkpoints``)."""

from __future__ import annotations

import json

import pytest

from bubblefree.checkpoints import is_moondream, moondream_tokenizer, text_templates, word_tokenizer
from bubblefree.cuda_backend.moondream.config import TokenizerConfig


def checkpoint(folder, config: dict | str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.parametrize("config,want", [
    ({"model_type": "moondream1", "architectures": ["HfMoondream"], "config": {}}, True),
    ({"model_type": "moondream2"}, True),
    ({"architectures": ["HfMoondream"]}, True),
    ({"config": {"text": {"n_layers": 2}, "tokenizer": {"bos_id": 0}}}, True),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, False),
    ({"config": {"text": {}, "unrelated": 1}}, False),
    ({"config": {}}, False),
    ("not json", False),
    ("[1, 2]", False),
])
def test_a_moondream_checkpoint_is_told_by_its_config(tmp_path, config, want):
    assert is_moondream(checkpoint(tmp_path / "m", config)) is want
    assert is_moondream(str(tmp_path / "m")) is want


def test_what_is_not_a_directory_is_not_moondream(tmp_path):
    (tmp_path / "file.gguf").write_bytes(b"GGUF")
    assert not is_moondream(tmp_path / "file.gguf")
    assert not is_moondream(tmp_path / "absent")
    assert not is_moondream(None) and not is_moondream(3)


def test_templates_outside_the_tokenizer_are_refused():
    raw = word_tokenizer()
    with pytest.raises(ValueError, match=r"use ids \[50256\]"):
        moondream_tokenizer(raw, TokenizerConfig(bos_id=50256, eos_id=0, templates=text_templates(raw)))
    with pytest.raises(ValueError, match=r"use ids \[198, 628"):
        moondream_tokenizer(raw, TokenizerConfig(bos_id=0, eos_id=0))  # GPT-2's ids: not this tokenizer's


def test_the_tokenizer_carries_the_configs_templates():
    raw = word_tokenizer()
    tok = moondream_tokenizer(raw, TokenizerConfig(bos_id=0, eos_id=0, templates=text_templates(raw)))
    assert tok.eos_id == 0 and len(tok) == raw.get_vocab_size() and tok.vocab[0] == "<|endoftext|>"
    ids = lambda text: raw.encode(text).ids  # noqa: E731
    assert tok.templates.query_prompt(tok, "what is this") == ids("Question:") + ids("what is this") + ids("Answer:")
    assert tok.templates.object_prompt(tok, "detect", "cat") == ids("Detect:") + ids(" cat")
    assert tok.templates.caption_prompt("long") == ids("Long caption:")
    assert tok.decode(ids("the cat")) == "the cat" and ids("a zebra") == [raw.token_to_id("a"), 1]
