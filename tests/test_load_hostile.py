"""Hostile model paths, checkpoints and server options: each is refused as one
load error naming the file, field or option that was wrong, never as a raw
traceback, and ``serve`` reports it in one line with exit 2 before serving."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from bubblefree.checkpoints import is_moondream, is_vision_language, moondream_tokenizer, word_tokenizer
from bubblefree.cuda_backend import gguf_cache
from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.moondream.config import TokenizerConfig
from bubblefree.cuda_backend.moondream.weights import CheckpointError, load_checkpoint
from bubblefree.cuda_backend.sizing import ModelDims, context_length
from bubblefree.server import cli
from image_world import tiny_checkpoint
from server_support import free_port  # bound, then closed: nothing listens there


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("good"))


def _copy(good, folder):
    folder.mkdir()
    for file in good.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


def _set_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _shard(folder):
    (folder / "model.safetensors").rename(folder / "part-1.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "part-1.safetensors"}}))


# Each fault, and what the error must name.
FAULTS = {
    "empty safetensors": (lambda d: (d / "model.safetensors").write_bytes(b""), "model.safetensors"),
    "truncated safetensors": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:100]), "model.safetensors"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{nope"), "config.json"),
    "config a list": (lambda d: _set_config(d, lambda c: c.update(config=[1, 2])), '"config"'),
    "config a string": (lambda d: _set_config(d, lambda c: c.update(config="x")), '"config"'),
    "part a list": (lambda d: _set_config(d, lambda c: c["config"].update(vision=[1])), "vision"),
    "templates a list": (lambda d: _set_config(
        d, lambda c: c["config"]["tokenizer"].update(templates=[1])), "tokenizer.templates"),
    "n_layers a word": (lambda d: _set_config(d, lambda c: c["config"]["text"].update(n_layers="two")),
                        "text.n_layers"),
    "n_heads 0": (lambda d: _set_config(d, lambda c: c["config"]["text"].update(n_heads=0)), "text.n_heads"),
    "index not JSON": (lambda d: (d / "model.safetensors.index.json").write_text("{"),
                       "model.safetensors.index.json"),
    "index without weight_map": (lambda d: (d / "model.safetensors.index.json").write_text("{}"),
                                 "weight_map"),
    "a listed shard missing": (lambda d: (_shard(d), (d / "part-1.safetensors").unlink()),
                               "part-1.safetensors"),
    "tokenizer.json not a tokenizer": (lambda d: (d / "tokenizer.json").write_text('{"x": 1}'),
                                       "tokenizer.json"),
    "no safetensors": (lambda d: (d / "model.safetensors").unlink(), "no .safetensors"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_moondream_checkpoint_is_a_load_error_naming_what(good, tmp_path, fault):
    spoil, named = FAULTS[fault]
    folder = _copy(good, tmp_path / "md")
    spoil(folder)
    with pytest.raises(ModelLoadError) as err:
        load_checkpoint(folder, dtype=torch.float32)
    assert isinstance(err.value, CheckpointError) and named in str(err.value)


def test_template_ids_outside_the_tokenizer_are_a_load_error():
    raw = word_tokenizer()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        moondream_tokenizer(raw, TokenizerConfig(bos_id=0, eos_id=0))  # GPT-2's ids


def test_serve_reports_a_bad_checkpoint_in_one_line(good, tmp_path, capsys):
    folder = _copy(good, tmp_path / "md")
    (folder / "model.safetensors").write_bytes(b"")
    assert cli.main(["serve", str(folder), "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(folder / "model.safetensors") in err, err


def test_an_empty_model_path_never_means_the_working_directory(good, monkeypatch, capsys):
    monkeypatch.chdir(good)
    assert not is_moondream("") and not is_vision_language("")
    monkeypatch.setattr(cli, "engine_maker", _no_load)
    assert cli.main(["serve", "", "--device", "cpu", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("bubblefree serve: error: model path: empty")


def test_a_name_too_long_is_not_a_checkpoint_and_does_not_raise(tmp_path):
    assert not is_moondream(tmp_path / ("x" * 300)) and not is_vision_language(tmp_path / ("x" * 300))


def _no_load(args):
    raise AssertionError("the model loaded before the options were checked")


@pytest.mark.parametrize("host", ["999.1.1.1", ""])
def test_the_host_is_checked_with_port_0_too(monkeypatch, capsys, host):
    monkeypatch.setattr(cli, "engine_maker", _no_load)
    assert cli.main(["serve", "--random", "moondream-tiny", "--host", host, "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"bubblefree serve: error: --host {host!r}")


@pytest.mark.parametrize("key", ["", " secret", "secret\n", "clé", "a\tb"])
def test_an_api_key_no_client_could_send_is_refused_at_startup(monkeypatch, capsys, key):
    monkeypatch.setattr(cli, "engine_maker", _no_load)
    assert cli.main(["serve", "--random", "moondream-tiny", "--api-key", key, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bubblefree serve: error: --api-key: ") and err.count("\n") == 1, err


def test_replicas_refuse_a_ray_address_nothing_answers_at_before_starting_ray(monkeypatch, capsys):
    """Ray retried such an address for minutes, its log repeating, and
    Ctrl-C then printed a traceback: now one line and exit 2, at once."""
    monkeypatch.setattr(cli, "engine_maker", _no_load)
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    started = time.monotonic()
    assert cli.main(["serve", "--random", "moondream-tiny", "--replicas", "1", "--port", "0"]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert err.startswith(f"bubblefree serve: error: RAY_ADDRESS {address!r}: nothing answers at "
                          f"{address}") and err.count("\n") == 1, err
    alone = cli.parser().parse_args(["serve", "--random", "moondream-tiny", "--port", "0"])
    assert cli.startup_refusal(alone) is None  # without replicas Ray's address is not ours


def test_a_ray_address_is_probed_only_where_it_names_a_host_and_port():
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}", f" 127.0.0.1:{port} "):
            assert cli.ray_address_refused(address) is None, address
    for address in ("", "auto", "local", "ray://", "some-head-node"):  # Ray's to resolve
        assert cli.ray_address_refused(address) is None, address
    closed = free_port()
    for address, names in [(f"127.0.0.1:{closed}", f"127.0.0.1:{closed}"),
                           (f"ray://127.0.0.1:{closed}", f"127.0.0.1:{closed}"),
                           (f"[::1]:{closed}", f"::1:{closed}"),
                           ("127.0.0.1:99999", "127.0.0.1:99999"),
                           ("no-such-host.invalid:6379", "no-such-host.invalid:6379")]:
        refused = cli.ray_address_refused(address, timeout_s=2.0)
        assert refused is not None and refused.startswith(f"RAY_ADDRESS {address!r}: nothing "
                                                          f"answers at {names} ("), refused


def test_a_cache_variable_naming_a_file_is_a_load_error(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("x")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("BUBBLEFREE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="BUBBLEFREE_CACHE"):
        gguf_cache.converted_dir(tmp_path / "m.gguf")


@pytest.mark.parametrize("positions", [0, -5])
def test_max_position_embeddings_below_1_is_a_load_error_naming_it(positions):
    dims = ModelDims(layers=1, hidden=8, intermediate=16, heads=2, kv_heads=2, head_dim=4, vocab=10,
                     max_positions=positions)
    with pytest.raises(ModelLoadError, match="config.json: max_position_embeddings"):
        context_length(dims, None)


def test_a_path_name_too_long_for_the_file_system_is_a_load_error(tmp_path):
    """``Path.is_file`` let ENAMETOOLONG through: a traceback from serve."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.loader import load_model
    with pytest.raises(ModelLoadError, match="model path .*: File name too long"):
        load_model(tmp_path / ("a" * 300), device="cpu")


def test_a_moondream_checkpoint_without_its_tokenizer_is_a_load_error(good, tmp_path):
    """A bare ValueError, a traceback from serve."""
    from bubblefree import Engine
    folder = _copy(good, tmp_path / "md")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="has no tokenizer.json; the skills need one"):
        Engine.from_pretrained(folder, device="cpu")


@pytest.mark.parametrize("key", ["", " secret", "clé", 5])
def test_server_settings_refuse_an_api_key_no_client_could_send(key):
    """The CLI's check held only there: an app built from Python with such
    a key served open (empty) or answered 401 to every request."""
    from bubblefree.server import ServerSettings
    with pytest.raises(ValueError, match="^api_key: "):
        ServerSettings(api_key=key)
    assert ServerSettings(api_key="s3cret-Key").api_key == "s3cret-Key"
