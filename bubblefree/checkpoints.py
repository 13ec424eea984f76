"""Which model a path holds, and moondream2's tokenizer as the skills see it.

Torch-free: ``Engine.from_pretrained`` asks ``is_moondream`` before it
imports any backend. A moondream2 checkpoint is a local directory with
``config.json`` (moondream's own: ``model_type`` "moondream1" or
"moondream2", the ``HfMoondream`` architecture, or a ``config`` of
moondream's parts), its weights as ``.safetensors`` and ``tokenizer.json``.
Anything else goes to the text-model loader as before.

``moondream_tokenizer`` wraps the checkpoint's ``tokenizers.Tokenizer`` in
the skills' ``HFTokenizer`` with the config's prompt templates;
``word_tokenizer`` is a small word-level one for random-weight models (tests
and benchmarks), with ids that fit the tiny config's 128.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bubblefree.skills import HFTokenizer
from bubblefree.skills.templates import TEXTS, MoondreamTemplates

MOONDREAM_TYPES = ("moondream1", "moondream2")
PARTS = ("vision", "text", "region", "tokenizer")
END = "<|endoftext|>"
# What a random-weight model's small tokenizer names moondream's coord_id and
# size_id (the inputs a spatial reference's values replace).
PLACEHOLDERS = ("<|coord|>", "<|size|>")  # moondream2's BOS and EOS (GPT-2's), id 0 in ``word_tokenizer``

WORDS = (
    "<unk>", ":", ".", ",", "?", "!", "Question", "Answer", "Short", "Long", "Caption", "caption",
    "Detect", "Point", "what", "What", "is", "are", "there", "in", "on", "of", "the", "a", "an",
    "this", "image", "picture", "photo", "describe", "Describe", "how", "many", "where", "which",
    "colour", "color", "and", "or", "yes", "no", "cat", "cats", "dog", "dogs", "person", "people",
    "car", "tree", "sky", "red", "blue", "green", "left", "right", "sits", "mat", "one", "two", "three",
)


def _config(path: Path) -> dict | None:
    try:
        value = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _directory(source: Any) -> Path | None:
    """``source`` as a directory path, or None. An empty path is none:
    ``Path("")`` is the working directory, and a server started with an
    unset variable as its model must not serve whatever checkpoint it was
    started in (the text loader refuses the empty path)."""
    if not isinstance(source, (str, os.PathLike)) or not os.fspath(source):
        return None
    path = Path(source)
    try:
        return path if path.is_dir() else None
    except OSError:  # a name too long, say: the loader's to report, not a crash here
        return None


def is_moondream(source: Any) -> bool:
    """Whether ``source`` is a local moondream2 checkpoint directory."""
    path = _directory(source)
    config = _config(path) if path is not None else None
    if config is None:
        return False
    if str(config.get("model_type", "")).lower() in MOONDREAM_TYPES:
        return True
    if "HfMoondream" in (config.get("architectures") or ()):
        return True
    inner = config.get("config")
    return isinstance(inner, dict) and bool(inner) and set(inner) <= set(PARTS)


def is_vision_language(source: Any) -> bool:
    """Whether ``source`` is a local transformers vision-language checkpoint
    (a config with a ``vision_config``: LLaVA and its kin; Qwen2-VL's
    published configs keep the text settings at the top level, not in a
    ``text_config``); which of them are served is the VLM backend's to say."""
    if is_moondream(source):
        return False
    path = _directory(source)
    config = _config(path) if path is not None else None
    return config is not None and isinstance(config.get("vision_config"), dict)


def moondream_tokenizer(raw: Any, config: Any) -> HFTokenizer:
    """The checkpoint's ``tokenizers.Tokenizer`` with the prompt templates and
    BOS/EOS of ``config`` (a ``TokenizerConfig``); every template id must be
    one of the tokenizer's."""
    from transformers import PreTrainedTokenizerFast

    from bubblefree.cuda_backend.errors import ModelLoadError  # here: this module imports no torch

    size = raw.get_vocab_size(with_added_tokens=True)
    templates = MoondreamTemplates.from_ids(config.bos_id, config.templates, config.coord_id, config.size_id)
    placeholders = [i for i in (config.coord_id, config.size_id) if i is not None]
    used = [config.bos_id, config.eos_id, *placeholders, *templates.query[0], *templates.query[1],
            *(i for ids in templates.captions.values() for i in ids),
            *templates.point[0], *templates.point[1], *templates.detect[0], *templates.detect[1]]
    outside = sorted({i for i in used if not 0 <= i < size})
    if outside:
        raise ModelLoadError(f"config.json: the tokenizer's BOS, EOS, placeholders or templates use ids "
                             f"{outside[:5]} that tokenizer.json ({size} tokens) lacks")
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=raw.id_to_token(config.eos_id),
                                 bos_token=raw.id_to_token(config.bos_id))
    return HFTokenizer.wrap(hf, templates=templates)


def word_tokenizer() -> Any:
    """A word-level ``tokenizers.Tokenizer``: ``<|endoftext|>`` (0), then
    ``WORDS``, then the spatial references' placeholders (``PLACEHOLDERS``);
    split on whitespace and punctuation, unknown words ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate((END, *WORDS, *PLACEHOLDERS))}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens([END, *PLACEHOLDERS])
    return raw


def placeholder_ids(raw: Any) -> dict:
    """``coord_id`` and ``size_id`` for a ``TokenizerConfig``: the
    placeholders' ids where ``raw`` holds them."""
    ids = {name: raw.token_to_id(token) for name, token in zip(("coord_id", "size_id"), PLACEHOLDERS)}
    return {name: i for name, i in ids.items() if i is not None}


def text_templates(raw: Any) -> dict:
    """moondream's templates (``skills.templates.TEXTS``) in ``raw``'s ids, in
    the layout of a config's ``TokenizerConfig.templates``."""
    return {skill: {part: tuple(raw.encode(text, add_special_tokens=False).ids)
                    for part, text in parts.items()} for skill, parts in TEXTS.items()}
