"""``bubblefree serve`` and the demo against bad arguments: settings out of
range are usage errors naming the flag, ports outside 0..65535 are refused
(not wrapped), a bad model path is one line without a traceback, Ctrl-C
while the model loads exits 130, the image limit reaches the engine, and
the demo checks its arguments before it loads anything."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from bubblefree.images import pillow_max_pixels
from bubblefree.server import cli


@pytest.mark.parametrize("flag,value,why", [
    ("--max-live", "0", "must be >= 1, got 0"), ("--max-live", "-3", "must be >= 1"),
    ("--max-body-bytes", "0", "must be >= 1"), ("--max-image-pixels", "-1", f"must be in [1, {pillow_max_pixels()}], got -1"),
    ("--timeout", "0", "must be > 0"), ("--timeout", "nan", "must be > 0"), ("--timeout", "-5", "must be > 0"),
    ("--port", "70000", "must be in [0, 65535]"), ("--port", "-1", "must be in [0, 65535]"),
    ("--replicas", "-1", "must be >= 0"), ("--max-live", "x", "must be an integer, got 'x'"),
    ("--max-json-values", "0", "must be >= 1"), ("--max-json-values", "1e6", "must be an integer"),
])
def test_a_setting_out_of_range_is_a_usage_error_naming_the_flag(capsys, flag, value, why):
    with pytest.raises(SystemExit) as exit_:
        cli.parser().parse_args(["serve", "--random", "moondream-tiny", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {why}" in err and "Traceback" not in err


def test_the_bounds_keep_the_defaults_and_the_edges():
    args = cli.parser().parse_args(["serve", "--port", "0", "--timeout", "inf", "--max-live", "1"])
    assert (args.port, args.timeout, args.max_live) == (0, float("inf"), 1)


def test_every_limit_given_reaches_the_server_settings():
    args = cli.parser().parse_args(["serve", "--max-json-values", "7", "--max-body-bytes", "9",
                                    "--max-image-pixels", "11", "--max-live", "3", "--timeout", "5",
                                    "--body-timeout", "4", "--max-header-bytes", "999", "--header-timeout", "2",
                                    "--stall-timeout", "6"])
    settings = cli.settings_of(args)
    assert (settings.max_json_values, settings.max_body_bytes, settings.max_image_pixels, settings.max_live,
            settings.request_timeout_s, settings.body_timeout_s, settings.max_header_bytes,
            settings.header_timeout_s, settings.stall_s) == (7, 9, 11, 3, 5, 4, 999, 2, 6)
    assert cli.settings_of(cli.parser().parse_args(["serve"])) == cli.ServerSettings(
        model_name="smollm2-135m-instruct")


@pytest.mark.parametrize("model", ["/nonexistent/model", "FILE", "EMPTYDIR", "BADGGUF", ""])
def test_a_bad_model_path_is_one_line_without_a_traceback(capsys, tmp_path, model):
    if model == "FILE":
        model = str(tmp_path / "notes.txt")
        Path(model).write_text("hello")
    elif model == "EMPTYDIR":
        model = str(tmp_path)
    elif model == "BADGGUF":
        model = str(tmp_path / "bad.gguf")
        Path(model).write_text("junk")
    assert cli.main(["serve", model, "--device", "cpu", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bubblefree serve: error: ") and err.count("\n") == 1, err
    if model.endswith("notes.txt"):
        assert "is a file, not a model directory or a .gguf file" in err
    if model == "":
        assert "model path: empty" in err


def test_ctrl_c_while_the_model_loads_exits_130_without_a_traceback(capsys, monkeypatch):
    def interrupted(args):
        def make():
            raise KeyboardInterrupt
        return make

    monkeypatch.setattr(cli, "engine_maker", interrupted)
    assert cli.main(["serve", "--device", "cpu", "--port", "0"]) == 130
    assert capsys.readouterr().err == "bubblefree serve: interrupted while loading the model\n"


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]])
def test_a_port_in_use_or_a_foreign_host_is_one_line_before_any_model_loads(capsys, monkeypatch,
                                                                          replicas):
    """Before, the model loaded (minutes for a large one) and then uvicorn,
    or Ray's proxy with a traceback, failed to listen."""
    import socket

    def no_load(args):
        raise AssertionError("the model loaded before the address was checked")
    monkeypatch.setattr(cli, "engine_maker", no_load)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = cli.main(["serve", "--random", "moondream-tiny", "--host", "127.0.0.1",
                         "--port", str(port), *replicas])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"bubblefree serve: error: --port {port} on 127.0.0.1: ") and "\n" not in err
    assert "in use" in err.lower()
    assert cli.main(["serve", "--random", "moondream-tiny", "--host", "192.0.2.1",  # TEST-NET: not ours
                     "--port", str(port), *replicas]) == 2
    err = capsys.readouterr().err.strip()
    # An address this machine does not have is the host's to change, not the port's.
    assert err.startswith("bubblefree serve: error: --host '192.0.2.1': ") and "\n" not in err
    assert "not an address of this machine" in err


def test_a_free_port_and_port_0_pass_the_address_check():
    import socket
    assert cli.address_refused("127.0.0.1", 0) is None
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    assert cli.address_refused("127.0.0.1", port) is None
    assert cli.address_refused("no-such-host.invalid", port).startswith("--host 'no-such-host.invalid': ")


def test_max_image_pixels_reaches_the_engine():
    """The server's flag bounds the engine's own check too (it kept its default)."""
    from bubblefree import InvalidRequest

    for limit, refused in ((60_000_000, False), (1_000, True)):
        args = cli.parser().parse_args(["serve", "--random", "moondream-tiny", "--device", "cpu",
                                        "--max-image-pixels", str(limit)])
        engine = cli.engine_maker(args)()
        try:
            assert engine.images.max_pixels == limit
            buf = io.BytesIO()
            Image.new("1", (7200, 7100)).save(buf, "PNG")  # 51 megapixels, a small file
            lazy = Image.open(io.BytesIO(buf.getvalue()))  # the size check comes before decoding
            if refused:
                with pytest.raises(InvalidRequest, match=f"over the limit of {limit}"):
                    engine.images.ref(lazy)
        finally:
            engine.close()


@pytest.fixture
def no_load(monkeypatch):
    from bubblefree import demo

    def load(*_, **__):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(demo.Engine, "from_pretrained", load)
    monkeypatch.delenv("BUBBLEFREE_MODEL", raising=False)
    return demo


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "-1"], ["--max-tokens", "0"],
                                  ["--max-tokens", "-4"], ["--rounds", "two"]])
def test_the_demo_refuses_bad_numbers_before_loading(no_load, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        no_load.main(argv)
    assert exit_.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err


def test_the_demo_refuses_a_missing_image_or_model_before_loading(no_load, capsys, tmp_path, monkeypatch):
    ckpt = tmp_path / "llava"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}, "text_config": {}}))
    with pytest.raises(SystemExit) as exit_:
        no_load.main(["--model", str(ckpt), "--image", str(tmp_path / "nonexistent.png")])
    assert exit_.value.code == 2 and "--image: no file at" in capsys.readouterr().err
    monkeypatch.setenv("BUBBLEFREE_MODEL", "/nonexistent/model")
    with pytest.raises(SystemExit) as exit_:
        no_load.main([])
    assert exit_.value.code == 2
    assert "'/nonexistent/model' is not a model directory or a .gguf file" in capsys.readouterr().err
