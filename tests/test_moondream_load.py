"""Loading moondream2: the engine ``from_pretrained`` assembles for a
checkpoint directory (its tokenizer, templates and region head) and
``moondream_random``'s, wired here to the simulated GPU in place of the
moondream backend, and options refused before anything is built."""

from __future__ import annotations

import json

import attrs
import pytest
from PIL import Image
from safetensors.torch import save_file

from bubblefree import Engine, InvalidRequest
from bubblefree.checkpoints import text_templates, word_tokenizer
from bubblefree.cuda_backend.moondream import build as moondream_build
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.weights import MoondreamCheckpoint, config_to_json
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.skills import RegionHeadCodec


def checkpoint(folder, model_type: str):
    """A directory with the tiny config, the word tokenizer and its
    templates, and a tensor file that holds none (the fake build reads no
    weights; opening the checkpoint reads the file's header)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = word_tokenizer()
    config = config_to_json(tiny_config())
    config["tokenizer"] = {"bos_id": 0, "eos_id": 0, "templates": text_templates(raw)}
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "config": config}))
    raw.save(str(folder / "tokenizer.json"))
    save_file({}, str(folder / "model.safetensors"))
    return folder


class FakeMoondream:
    """``cuda_backend.moondream.build.build`` on the simulated GPU: the same
    call, a FakeBackend of the config's vocabulary, the checkpoint's tokenizer."""

    def __init__(self):
        self.calls = []

    def __call__(self, source, *, device, dtype, seed, **options):
        self.calls.append((source, device, dtype, seed, dict(options)))
        options.pop("crops_on_device")  # moondream's own option; the fake cuts no crops
        opened = isinstance(source, MoondreamCheckpoint)
        config = source.config if opened else source
        backend = FakeBackend(model=FakeModel(vocab_size=config.text.vocab_size, eos_id=0),
                              num_pages=256, max_context=512, max_prefill_tokens=128, **options)
        info = moondream_build.MoondreamInfo(config=config, tokenizer=source.tokenizer if opened else None)
        return backend, info


@pytest.fixture
def fake_build(monkeypatch):
    fake = FakeMoondream()
    monkeypatch.setattr(moondream_build, "build", fake)
    return fake


def test_from_pretrained_on_a_moondream_directory_builds_moondreams_engine(tmp_path, fake_build):
    path = checkpoint(tmp_path / "md", "moondream1")
    engine = Engine.from_pretrained(path, max_rows=4, device="cpu")
    try:
        options = {"max_rows": 4, "crops_on_device": True}  # the crops' default: on the device
        # The directory as load_checkpoint takes it: opened and checked, its weights not yet read.
        assert fake_build.calls[0][0].directory == path and fake_build.calls[0][4] == options
        tok = engine.skills.tokenizer
        assert isinstance(engine.skills.codec, RegionHeadCodec) and engine.takes_images
        # moondream's prompts: template ids around the words, " " before the object.
        query = engine.submit("query", image=Image.new("RGB", (8, 8)), question="what is this", max_tokens=2)
        assert tok.decode(query.request.prompt) == "Question : what is this Answer :"
        point = engine.submit("point", image=Image.new("RGB", (8, 8)), object="cat", max_tokens=2)
        assert list(point.request.prompt) == [*tok.encode("Point:"), *tok.encode(" cat")]
        assert engine.submit("query", question="what", max_tokens=1).request.prompt[0] == tok.templates.bos_id
        points = engine.point(Image.new("RGB", (8, 8), "red"), "cat", settings={"max_objects": 2})["points"]
        assert len(points) <= 2 and all(0 <= p["x"] <= 1 for p in points)
        with pytest.raises(InvalidRequest, match="^skill: a model with a region head"):
            engine.segment(Image.new("RGB", (8, 8)), "cat")
    finally:
        engine.close()


def test_a_random_moondream_takes_its_tokenizers_ids(fake_build):
    engine = Engine.moondream_random("tiny", seed=3, device="cpu")
    try:
        source, _, _, seed, _ = fake_build.calls[0]
        raw = word_tokenizer()
        assert seed == 3 and source.tokenizer.bos_id == source.tokenizer.eos_id == raw.token_to_id("<|endoftext|>")
        assert source.tokenizer.templates == text_templates(raw)
        assert engine.skills.tokenizer.templates.query == (tuple(raw.encode("Question:").ids),
                                                           tuple(raw.encode("Answer:").ids))
        assert isinstance(engine.caption(Image.new("RGB", (8, 8)), max_tokens=3)["caption"], str)
    finally:
        engine.close()


@pytest.mark.parametrize("call,field", [
    (lambda: Engine.moondream_random("huge"), "config"),
    (lambda: Engine.moondream_random("tiny", seed=-1), "seed"),
    (lambda: Engine.moondream_random("tiny", seed=True), "seed"),
    (lambda: Engine.moondream_random("tiny", location_tokens=True), "location_tokens"),
    (lambda: Engine.moondream_random("tiny", max_rows=0), "max_rows"),
    (lambda: Engine.moondream_random("tiny", colour="red"), "colour"),
    (lambda: Engine.moondream_random("tiny", device="tpu"), "device"),
    (lambda: Engine.moondream_random("tiny", pipelined="yes"), "pipelined"),
    (lambda: Engine.moondream_random("tiny", crops_on_device="yes"), "crops_on_device"),
    (lambda: Engine.moondream_random("tiny", crops_on_device=1), "crops_on_device"),
])
def test_bad_options_are_refused_before_anything_is_built(fake_build, call, field):
    with pytest.raises(InvalidRequest) as err:
        call()
    assert str(err.value).startswith(f"{field}:"), err.value
    assert fake_build.calls == []


@pytest.mark.parametrize("vision,message", [
    ({"crop_size": 380}, "vision.crop_size 380 must be a multiple of vision.patch_size 14"),
    ({"overlap_margin": 14}, r"vision.overlap_margin 14: twice it must be under the 27 patches"),
])
def test_crop_geometry_the_tiling_cannot_cut_is_refused_naming_the_field(tmp_path, vision, message):
    """It loaded, and the first image failed inside the crop tiling."""
    from bubblefree.cuda_backend.moondream.config import MoondreamConfig
    from bubblefree.cuda_backend.moondream.weights import CheckpointError, config_from_json
    config = tiny_config()
    with pytest.raises(ValueError, match=message):
        MoondreamConfig(vision=attrs.evolve(config.vision, **vision), text=config.text,
                        region=config.region, tokenizer=config.tokenizer)
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        config_from_json({"vision": vision})
    assert MoondreamConfig(vision=attrs.evolve(config.vision, overlap_margin=13), text=config.text,
                           region=config.region, tokenizer=config.tokenizer).vision.overlap_margin == 13
