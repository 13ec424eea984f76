"""Bad input is a clear error naming the problem: a missing or corrupt model,
an architecture that is not a decoder, a cache without room for one page.
Plans the backend cannot run are the contract's (test_backend_contract.py)."""

from __future__ import annotations

import pytest
from transformers import T5Config, ViTConfig

from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import CacheTooSmall, ModelLoadError, UnsupportedModel
from bubblefree.cuda_backend.kv_cache import pages_that_fit
from bubblefree.cuda_backend.loader import load_model
from bubblefree.cuda_backend.tiny import tiny_model


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, device="cpu")


def test_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="cannot read config.json"):
        load_model(tmp_path, device="cpu")


def test_corrupt_weights(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot load weights"):
        load_model(tmp_path, device="cpu")


def test_a_saved_tiny_model_loads_without_tokenizer(tmp_path):
    tiny_model("phi").save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.tokenizer is None and loaded.stop_ids == frozenset({2})
    with pytest.raises(ValueError, match="no tokenizer"):
        loaded.add_tokens(["<x>"])


def test_missing_and_corrupt_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "absent.gguf", device="cpu")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(bad, device="cpu", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # nothing half-written kept


@pytest.mark.parametrize("config, words", [(T5Config(), "encoder-decoder"),
                                           (ViTConfig(), "not a causal decoder")])
def test_not_a_decoder(tmp_path, config, words):
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match=words):
        load_model(tmp_path, device="cpu")


def test_too_little_memory_for_one_page():
    with pytest.raises(CacheTooSmall, match="one page"):
        pages_that_fit(10 << 20, 8 << 20)
    with pytest.raises(CacheTooSmall, match="num_pages"):
        CudaBackend(tiny_model("llama"), num_pages=0)
