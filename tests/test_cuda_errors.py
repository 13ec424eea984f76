"""Bad input is a clear error naming the problem: a missing or corrupt model,
an architecture that is not a decoder, a cache without room for one page, a
plan the backend cannot run (a prompt past the context, say)."""

from __future__ import annotations

import pytest
from transformers import T5Config, ViTConfig

from bubblefree.core.values import InvalidRequest, SamplePlan, StepFailed, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import CacheTooSmall, ModelLoadError, PlanRejected, UnsupportedModel
from bubblefree.cuda_backend.kv_cache import pages_that_fit
from bubblefree.cuda_backend.loader import load_model
from bubblefree.cuda_backend.tiny import tiny_model


@pytest.fixture(scope="module")
def backend():
    return CudaBackend(tiny_model("llama"), page_size=4, num_pages=32, max_rows=4, max_seqs=4,
                       max_prefill_tokens=40, max_context=48, min_graph_context=8)


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


def row(seq=0, slot=0, tokens=(1, 2, 3), position=0, pages=(0, 1)):
    return StepRow(seq_id=seq, row_slot=slot, tokens=tokens, position=position, pages=pages)


@pytest.mark.parametrize("rows, words", [
    ((row(tokens=(1,) * 50, pages=tuple(range(13))),), "40"),  # over max_prefill_tokens
    ((row(tokens=(1,) * 30, position=20, pages=tuple(range(13))),), "context of 48"),
    ((row(tokens=(1,) * 5, pages=(0,)),), "cannot hold"),
    ((row(pages=(0, 32)),), "page id"),
    ((row(slot=4),), "row_slot"),
    ((row(tokens=(1, 128)),), "vocabulary"),
    ((row(), row(seq=1)), "share a row_slot"),
    (tuple(row(seq=i, slot=i % 4) for i in range(5)), "rows"),
])
def test_plans_the_backend_cannot_run(backend, rows, words):
    plan = StepPlan(0, StepKind.PREFILL, rows)
    with pytest.raises(PlanRejected, match=words) as err:
        backend.launch(0, plan)
    assert isinstance(err.value, InvalidRequest) and isinstance(err.value, StepFailed)
    ok = StepPlan(1, StepKind.PREFILL, (row(),))  # the slot is untouched and still usable
    backend.launch(0, ok)
    backend.finalize(0, SamplePlan(1, (None,)))
    assert len(backend.wait(0).tokens) == 1
    backend.release(0)


def test_decode_row_with_tokens_and_unknown_mask(backend):
    with pytest.raises(PlanRejected, match="carry no tokens"):
        backend.launch(1, StepPlan(0, StepKind.DECODE, (row(),)))
    backend.launch(1, StepPlan(0, StepKind.PREFILL, (row(),)))
    with pytest.raises(PlanRejected, match="never registered"):
        backend.finalize(1, SamplePlan(0, (99,)))
    backend.release(1)
