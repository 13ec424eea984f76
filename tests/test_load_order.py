"""A checkpoint directory is checked before its weights are read.

Reading the weights of a real checkpoint takes minutes and GBs of device
memory; a directory whose tokenizer, processor, chat template or image token
cannot serve must be refused before any of that, with the same load error it
always had. Each test spoils one such file of a tiny checkpoint, expects the
error, and asserts the weight loader was never entered: for a
transformers vision-language checkpoint ``vlm.load.load_weights``; for
moondream2 ``weights._read_state`` (the tensors read) and
``Moondream.to_empty`` (the model allocated on its device). A good
directory loads through the same recorders, so they are known to see a
load when there is one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bubblefree import Engine
from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.moondream import weights as moondream_weights
from bubblefree.cuda_backend.moondream.model import Moondream
from bubblefree.cuda_backend.moondream.weights import CheckpointError, load_checkpoint
from bubblefree.cuda_backend.vlm import load as vlm_load
from tests import vlm_world
from tests.image_world import tiny_checkpoint

OPTIONS = dict(device="cpu", page_size=16, num_pages=64, max_rows=4, max_seqs=8)


# -- recorders -------------------------------------------------------------------

@pytest.fixture
def vlm_weights(monkeypatch):
    """The directories whose weights the VLM loader read (it still reads them)."""
    read, real = [], vlm_load.load_weights

    def recording(cls, path, **kwargs):
        read.append(path)
        return real(cls, path, **kwargs)

    monkeypatch.setattr(vlm_load, "load_weights", recording)
    return read


@pytest.fixture
def moondream_weights_read(monkeypatch):
    """moondream's weight steps taken: the model allocated, the tensors read."""
    taken, allocate, read = [], Moondream.to_empty, moondream_weights._read_state

    def allocating(self, *args, **kwargs):
        taken.append("allocated")
        return allocate(self, *args, **kwargs)

    def reading(files):
        taken.append("read")
        return read(files)

    monkeypatch.setattr(Moondream, "to_empty", allocating)
    monkeypatch.setattr(moondream_weights, "_read_state", reading)
    return taken


# -- transformers vision-language checkpoints -----------------------------------

@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return vlm_world.checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return vlm_world.checkpoint(tmp_path_factory.mktemp("qwen"), text_type="qwen2", arch="qwen2_vl")


def _copy(source, tmp_path):
    return shutil.copytree(source, tmp_path / source.name)


def _edit_json(file, edit):
    value = json.loads(file.read_text())
    edit(value)
    file.write_text(json.dumps(value))


def _no_chat_template(path):
    (path / "chat_template.jinja").unlink()
    _edit_json(path / "tokenizer_config.json", lambda c: c.pop("chat_template", None))


# Each spoiled directory (which checkpoint, the spoiling) and the error it always had.
VLM_FAULTS = {
    "llava without its tokenizer": (
        "llava", lambda d: (d / "tokenizer.json").unlink(), "cannot load its processor"),
    "llava with a tokenizer.json that is no tokenizer": (
        "llava", lambda d: (d / "tokenizer.json").write_text("{nope"), "cannot load its processor"),
    "llava with a processor_config.json that is not JSON": (
        "llava", lambda d: (d / "processor_config.json").write_text("{nope"), "cannot load its processor"),
    "qwen2-vl without its tokenizer": (
        "qwen", lambda d: (d / "tokenizer.json").unlink(), "cannot load its tokenizer and image processor"),
    "qwen2-vl without its image processor": (
        "qwen", lambda d: (d / "preprocessor_config.json").unlink(),
        "cannot load its tokenizer and image processor"),
    "llava without a chat template": ("llava", _no_chat_template, "has no chat template"),
    "a tokenizer past the language model's embeddings": (
        "llava", lambda d: _edit_json(d / "config.json", lambda c: c["text_config"].update(vocab_size=8)),
        "its tokenizer has .* tokens and its language model 8 embeddings"),
    "an image token outside the vocabulary": (
        "llava", lambda d: _edit_json(d / "config.json", lambda c: c.update(image_token_index=999)),
        "image_token_id 999 is not one of the tokenizer's"),
}


@pytest.mark.parametrize("fault", sorted(VLM_FAULTS))
def test_a_vlm_directory_that_cannot_serve_is_refused_before_its_weights(
        fault, llava, qwen, tmp_path, vlm_weights):
    which, spoil, says = VLM_FAULTS[fault]
    path = _copy({"llava": llava, "qwen": qwen}[which], tmp_path)
    spoil(path)
    with pytest.raises(ModelLoadError, match=says):
        vlm_load.load_vision_language(path, device="cpu")
    assert vlm_weights == []


def test_a_chat_template_without_the_image_is_refused_before_the_weights(llava, tmp_path, vlm_weights):
    """``HFTokenizer.wrap``'s check, which ``build_vision_language`` makes."""
    path = _copy(llava, tmp_path)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ModelLoadError, match="the chat template renders 0 image tokens"):
        Engine.from_pretrained(str(path), **OPTIONS)
    assert vlm_weights == []


def test_a_good_vlm_directory_reads_its_weights_once(llava, vlm_weights):
    loaded = vlm_load.load_vision_language(llava, device="cpu", dtype=torch.float32)
    assert vlm_weights == [llava]
    assert loaded.image_token == (vlm_world.WORDS.index("<image>"), "<image>")
    assert loaded.tokenizer.chat_template == vlm_world.TEMPLATE


# -- moondream2 ------------------------------------------------------------------

@pytest.fixture(scope="module")
def moondream(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("moondream"))


def test_a_moondream_tokenizer_json_that_is_no_tokenizer_is_refused_before_the_weights(
        moondream, tmp_path, moondream_weights_read):
    path = _copy(moondream, tmp_path)
    (path / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot read it as a tokenizer"):
        load_checkpoint(path, dtype=torch.float32)
    assert moondream_weights_read == []


def test_a_moondream_directory_without_its_tokenizer_is_refused_before_the_weights(
        moondream, tmp_path, moondream_weights_read):
    path = _copy(moondream, tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="has no tokenizer.json; the skills need one"):
        Engine.from_pretrained(path, device="cpu")
    assert moondream_weights_read == []


def test_moondream_template_ids_outside_its_tokenizer_are_refused_before_the_weights(
        moondream, tmp_path, moondream_weights_read):
    path = _copy(moondream, tmp_path)
    _edit_json(path / "config.json", lambda c: c["config"]["tokenizer"].update(bos_id=5000))
    with pytest.raises(ModelLoadError, match=r"use ids \[5000\] that tokenizer.json .* lacks"):
        Engine.from_pretrained(path, device="cpu")
    assert moondream_weights_read == []


def test_a_moondream_tensor_file_cut_short_is_refused_before_the_model_is_allocated(
        moondream, tmp_path, moondream_weights_read):
    """A download cut short: its header says more bytes than the file has,
    found when the checkpoint is opened, not after the model's allocation."""
    path = _copy(moondream, tmp_path)
    file = next(path.glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="cannot read it as safetensors"):
        load_checkpoint(path, dtype=torch.float32)
    assert moondream_weights_read == []


def test_a_good_moondream_directory_allocates_and_reads_its_weights_once(moondream, moondream_weights_read):
    loaded = load_checkpoint(moondream, dtype=torch.float32)
    assert moondream_weights_read == ["allocated", "read"]
    assert loaded.tokenizer is not None and loaded.tokenizer.token_to_id("<|endoftext|>") == 0
