"""Loading a local moondream2 checkpoint directory; random weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from bubblefree.cuda_backend.moondream.config import MOONDREAM2, tiny_config
from bubblefree.cuda_backend.moondream.weights import (CheckpointError, config_from_json,
                                                       config_to_json, load_checkpoint,
                                                       random_model)


def _write(directory, state, config=tiny_config()):
    save_file({f"model.{k}": v.contiguous() for k, v in state.items()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"config": config_to_json(config)}))


def test_a_saved_checkpoint_loads_back_tensor_for_tensor(tmp_path):
    source = random_model(tiny_config(), seed=1)
    state = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    _write(tmp_path, state)
    loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    assert loaded.config == tiny_config() and loaded.tokenizer is None
    for name, tensor in loaded.model.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name].float()), name


def test_a_tokenizer_json_is_loaded(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    _write(tmp_path, random_model(tiny_config()).state_dict())
    loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    assert loaded.tokenizer.encode("hello world").ids == [0, 1]


def test_a_missing_tensor_is_named(tmp_path):
    state = random_model(tiny_config()).state_dict()
    del state["region.size_features"]
    _write(tmp_path, state)
    with pytest.raises(CheckpointError, match="region.size_features"):
        load_checkpoint(tmp_path)


def test_a_wrong_shape_is_named(tmp_path):
    state = random_model(tiny_config()).state_dict()
    state["vision.pos_emb"] = torch.zeros(1, 728, 32)
    _write(tmp_path, state)
    with pytest.raises(CheckpointError, match=r"vision.pos_emb.*\(1, 728, 32\)"):
        load_checkpoint(tmp_path)


def test_a_directory_without_tensors_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no .safetensors"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "absent")


def test_config_json_uses_moondreams_names_and_round_trips():
    written = config_to_json(tiny_config())
    assert written["vision"]["enc_dim"] == 32 and "dim" not in written["vision"]
    assert config_from_json(written) == tiny_config()
    assert config_from_json({}) == MOONDREAM2
    with pytest.raises(CheckpointError, match="n_kv_heads"):
        config_from_json({"text": {"n_heads": 32, "n_kv_heads": 8}})
    with pytest.raises(CheckpointError, match="unknown vision field 'colour'"):
        config_from_json({"vision": {"colour": 1}})


def test_random_weights_are_seeded_and_layer_norms_start_near_one():
    a, b = random_model(tiny_config(), seed=5), random_model(tiny_config(), seed=5)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert abs(a.text.post_ln.weight.mean().item() - 1) < 0.1
    assert a.vision.pos_emb.abs().sum() > 0 and a.region.coord_features.abs().sum() > 0


def _legacy(name: str) -> str:
    # The older release's names, as its loader reads them, written out per part.
    parts = name.split(".")
    if name == "vision.pos_emb":
        return "vision_encoder.encoder.model.visual.pos_embed"
    if parts[:2] == ["vision", "patch_emb"]:
        return "vision_encoder.encoder.model.visual.patch_embed.linear." + parts[2]
    if parts[:2] == ["vision", "post_ln"]:
        return "vision_encoder.encoder.model.visual.norm." + parts[2]
    if parts[:2] == ["vision", "blocks"]:
        rest = ".".join(parts[3:]).replace("ln1", "norm1").replace("ln2", "norm2")
        return f"vision_encoder.encoder.model.visual.blocks.{parts[2]}.{rest}"
    if parts[:2] == ["vision", "proj_mlp"]:
        return "vision_encoder.projection.mlp." + ".".join(parts[2:])
    if name == "text.wte":
        return "text_model.transformer.embd.wte.weight"
    if parts[:2] == ["text", "post_ln"]:
        return "text_model.lm_head.ln." + parts[2]
    if parts[:2] == ["text", "lm_head"]:
        return "text_model.lm_head.linear." + parts[2]
    if parts[:2] == ["text", "blocks"]:
        rest = ".".join(parts[3:]).replace("attn.qkv", "mixer.Wqkv").replace("attn.proj",
                                                                             "mixer.out_proj")
        return f"text_model.transformer.h.{parts[2]}._orig_mod.{rest}"
    if name == "region.coord_features":
        return "region_model.coordinate_features.weight"
    if name == "region.size_features":
        return "region_model.size_features.weight"
    return "region_model." + name.removeprefix("region.").replace("coord_", "coordinate_")


def test_the_older_release_layout_loads_under_our_names(tmp_path):
    source = random_model(tiny_config(), seed=2)
    state = {_legacy(k): (v.T if k.endswith("_features") else v).contiguous()
             for k, v in source.state_dict().items()}
    assert "text_model.transformer.h.0._orig_mod.mixer.Wqkv.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"config": config_to_json(tiny_config())}))
    loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, source.state_dict()[name]), name


def test_config_json_templates_and_fields_left_off():
    config = config_from_json({"tokenizer": {"templates": {"point": {"prefix": [198, 198, 12727, 25],
                                                                     "suffix": [628]},
                                                           "detect": None}},
                               "region": {"group_size": None}})
    assert config.tokenizer.template("point", "prefix") == (198, 198, 12727, 25)
    assert config.tokenizer.templates["detect"] is None
    with pytest.raises(CheckpointError, match="group_size=128 is not supported"):
        config_from_json({"region": {"group_size": 128}})
