"""Writing a skill of your own, as docs/skills.md tells it: the worked
example runs as written and is yesno.py's, and a registry reaches every
engine builder, checked before the model loads. (How the engine holds a
skill's bugs: ``test_skills_guards.py``.)"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from bubblefree import Engine, InvalidRequest, Status
from bubblefree.skills import LocationCodec, SkillSet
from bubblefree.skills.registry import BUILTIN
from bubblefree.skills.text import Query
from tests.serving_world import WAIT, make_engine

DOCS = Path(__file__).resolve().parent.parent / "docs" / "skills.md"


# -- the worked example in docs/skills.md ---------------------------------------

def _docs_example() -> dict:
    """The worked example's code blocks, run together as one module (all
    but the one that loads a model to register it)."""
    text = DOCS.read_text()
    section = text[text.index("## Adding a skill: a worked example"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace: dict = {}
    exec(compile("".join(b for b in blocks if "from_pretrained" not in b), str(DOCS), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def bpe():
    from bubblefree.skills import HFTokenizer, location_tokens
    from tests.small_tokenizer import small_bpe_tokenizer

    return HFTokenizer.wrap(small_bpe_tokenizer(), add_tokens=location_tokens(16, 8))


def test_the_docs_worked_example_runs_as_written_and_is_yesno_py(bpe):
    """The docs' example encoded the question itself: it let a question
    spelling EOS or a location token into the prompt as that token, and
    skipped the chat template. Its arguments and tables were never shown,
    and as named it clashes with the built-in ``yesno``."""
    YesNo = _docs_example()["YesNo"]
    with pytest.raises(ValueError, match="a skill named 'yesno' is already registered"):
        BUILTIN.with_skill(YesNo())
    registry = BUILTIN.with_skill(YesNo(name="docs_yesno"))
    skills = SkillSet(bpe, lambda allowed: 0, codec=LocationCodec.for_tokenizer(bpe, coord_bins=16, size_bins=8),
                      registry=registry)
    ask = "is the sky blue"
    assert skills.request("docs_yesno", question=ask).prompt == skills.request("yesno", question=ask).prompt
    with pytest.raises(InvalidRequest, match="^prompt: spells the model's special token '<|endoftext|>'"):
        skills.request("docs_yesno", question="is it <|endoftext|> here")
    eng = make_engine(registry=registry)
    try:
        assert eng.run("docs_yesno", question=ask)["answer"] in (True, False)
    finally:
        eng.close()


def test_the_docs_say_where_a_skills_hooks_run_and_how_prompts_are_checked():
    text = DOCS.read_text()
    tokenizers = text[text.index("### Tokenizers"):text.index("## Built-in skills")]
    assert "prompt(frame," in tokenizers and "check_user_text" in tokenizers
    example = text[text.index("## Adding a skill"):]
    hooks = example[example.index("**Where its hooks run.**"):example.index("**0.")]
    assert "decode thread" in hooks and "compile" in hooks
    for hook in ("start", "mask_id", "advance", "finish", "may_end", "value_kind"):
        assert f"`{hook}`" in hooks, hook
    assert "registry=" in example[example.index("**Register it**"):]


# -- a registry for every engine builder, checked before loading ------------------

@attrs.frozen
class _Mine(Query):
    name: str = "mine"


MINE = BUILTIN.with_skill(_Mine())


def _checkpoint(path: Path, config: str) -> str:
    path.mkdir()
    (path / "config.json").write_text(config)
    return str(path)


def test_a_registry_that_is_not_one_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """There was no ``registry=``: it fell to the backend's options,
    refused as an unknown option."""
    import bubblefree.build as build
    import bubblefree.cuda_backend.moondream.build as moondream_build
    import bubblefree.cuda_backend.vlm.load as vlm_load

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")
    for module, name in ((build, "load_model"), (moondream_build, "build"), (vlm_load, "load_vision_language")):
        monkeypatch.setattr(module, name, load)
    refused = "^registry: must be a bubblefree.skills.registry.Registry"
    moondream = _checkpoint(tmp_path / "moondream", '{"model_type": "moondream2"}')
    vlm = _checkpoint(tmp_path / "vlm", '{"model_type": "llava", "vision_config": {}}')
    for source in (None, moondream, vlm):
        with pytest.raises(InvalidRequest, match=refused):
            Engine.from_pretrained(source, device="cpu", registry={"mine": _Mine()})
    with pytest.raises(InvalidRequest, match=refused):
        Engine.moondream_random("tiny", device="cpu", registry=[_Mine()])


def _text_model(path: Path) -> str:
    from bubblefree.cuda_backend.tiny import tiny_model
    from tests.small_tokenizer import small_bpe_tokenizer

    tok = small_bpe_tokenizer()
    tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _vlm_model(path: Path) -> str:
    from tests import vlm_world

    return str(vlm_world.checkpoint(path))


SMALL = dict(device="cpu", page_size=16, num_pages=64, max_rows=4, max_seqs=8)


@pytest.mark.parametrize("build", [
    lambda tmp: Engine.from_pretrained(_text_model(tmp), registry=MINE, **SMALL),
    lambda tmp: Engine.moondream_random("tiny", registry=MINE, **dict(SMALL, num_pages=400)),
    lambda tmp: Engine.from_pretrained(_vlm_model(tmp), registry=MINE, **SMALL),
], ids=["text", "moondream", "vision-language"])
def test_a_registry_reaches_the_skill_set_of_every_builder(build, tmp_path):
    eng = build(tmp_path)
    try:
        assert eng.skills.registry is MINE
        result = eng.submit("mine", question="what is it", max_tokens=3).result(WAIT)
        assert result.status is Status.COMPLETED, result.finish_reason
    finally:
        eng.close()
