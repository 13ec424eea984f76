"""Engine.from_pretrained on a small model directory: a load prints nothing,
location tokens come only when asked for (and without them the spatial
skills refuse, the text skills serve), and bad options are refused with
InvalidRequest naming the option before any model is loaded."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from bubblefree import Engine, InvalidRequest
from bubblefree.cuda_backend import CudaBackend
from bubblefree.cuda_backend.options import BACKEND_OPTIONS
from bubblefree.cuda_backend.tiny import tiny_model
from bubblefree.skills import location_tokens
from small_tokenizer import small_bpe_tokenizer

SMALL = dict(max_rows=4, max_seqs=8, num_pages=64, max_prefill_tokens=128, max_context=256,
             device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tok = small_bpe_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def text_engine(model_dir):
    engine = Engine.from_pretrained(str(model_dir), **SMALL)
    yield engine
    engine.close()


def test_a_load_prints_no_warning_or_progress_bar(model_dir, capfd):
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    for tokens in (False, True):  # True grows the embeddings, which transformers warns about
        Engine.from_pretrained(str(model_dir), location_tokens=tokens, **SMALL).close()
    out, err = capfd.readouterr()
    for noise in ("Loading weights", "it/s]", "%|", "embeddings", "mean_resizing"):
        assert noise not in out and noise not in err, (noise, out, err)
    # The quiet is scoped to the load: transformers' settings are as they were.
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == (verbosity, bars)


def test_a_text_model_gets_no_location_tokens_by_default(text_engine, model_dir):
    assert text_engine.skills.codec is None
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    assert text_engine.backend.vocab_size == len(text_engine.skills.tokenizer) == vocab
    # Free text may use the whole vocabulary: nothing is set aside for locations.
    mask = text_engine.skills.tables("query").mask
    assert text_engine.skills.allowed(mask) == frozenset(range(vocab))


@pytest.mark.parametrize("skill", ["point", "detect", "segment"])
def test_spatial_skills_refuse_without_location_tokens(text_engine, skill):
    with pytest.raises(InvalidRequest) as err:
        text_engine.run(skill, object="the cat")
    message = str(err.value)
    assert message.startswith("skill:") and repr(skill) in message
    assert "no location tokens or region head" in message and "location_tokens=True" in message


def test_text_skills_serve_without_location_tokens(text_engine):
    assert isinstance(text_engine.query("what is the cat?", max_tokens=4)["answer"], str)
    assert isinstance(text_engine.caption("short", max_tokens=4)["caption"], str)
    assert text_engine.run("yesno", question="is the cat on a mat?")["answer"] in (True, False)


def test_location_tokens_on_request(model_dir):
    with Engine.from_pretrained(str(model_dir), location_tokens=True, **SMALL) as engine:
        added = len(location_tokens())
        assert added == 1088
        vocab = len(AutoTokenizer.from_pretrained(model_dir))
        assert engine.backend.vocab_size == len(engine.skills.tokenizer) == vocab + added
        assert engine.skills.codec is not None
        points = engine.point("the cat", max_tokens=5)["points"]
        assert all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)


BAD = [
    ("page_size", 1.5), ("page_size", 0), ("page_size", True), ("num_pages", "64"),
    ("num_pages", 0), ("kv_memory_fraction", 0.0), ("kv_memory_fraction", 1.5),
    ("kv_memory_fraction", float("nan")), ("kv_memory_fraction", "0.5"), ("max_rows", -1),
    ("max_rows", False), ("max_seqs", 2.0), ("max_context", 0), ("max_context", "1024"),
    ("max_prefill_tokens", None), ("fused_decode", 1), ("fused_decode", "yes"),
    ("use_graphs", None), ("prefill_graphs", 1), ("compile_decode", 0), ("token_prefill", -1),
    ("min_graph_context", 0), ("mask_capacity", 1.0),
]
LOAD_BAD = [("dtype", "int8"), ("dtype", torch.int32), ("dtype", 16), ("device", 3),
            ("device", "gpu"), ("device", "meta"), ("pipelined", "yes"),
            ("location_tokens", 1), ("page_sise", 16)]


@pytest.mark.parametrize("name,value", BAD + LOAD_BAD)
def test_bad_options_name_the_option_before_a_model_loads(name, value, monkeypatch):
    import bubblefree.build

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(bubblefree.build, "load_model", no_load)
    options = dict(SMALL, **{name: value})
    with pytest.raises(InvalidRequest) as err:
        Engine.from_pretrained(None, **options)
    assert str(err.value).startswith(f"{name}: "), err.value
    if name != "page_sise":
        assert repr(value) in str(err.value)


@pytest.mark.parametrize("name,value", BAD)
def test_the_backend_refuses_the_same_values(name, value):
    with pytest.raises(InvalidRequest, match=f"^{name}: "):
        CudaBackend(tiny_model("llama"), **{"num_pages": 64, name: value})


def test_every_backend_option_is_checked():
    params = inspect.signature(CudaBackend.__init__).parameters
    assert set(BACKEND_OPTIONS) == {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


def test_good_values_still_build():
    be = CudaBackend(tiny_model("llama"), page_size=8, num_pages=32, kv_memory_fraction=1,
                     max_rows=2, max_seqs=4, max_context=None, compile_decode=None,
                     token_prefill=None, use_graphs=False)
    assert be.capacity.page_size == 8 and be.capacity.num_pages == 32
