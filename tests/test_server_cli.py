"""``python -m bubblefree serve``: its options, loopback by default, and a
random-weight moondream2 (``--random``) served as the load benchmark
serves it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bubblefree.bench import load
from bubblefree.server.cli import main, parser
from server_support import free_port, healthy, interrupt


def test_serve_defaults_to_loopback_on_moondreams_port():
    args = parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 2020, None, None)


def test_python_dash_m_bubblefree_serve_help():
    out = subprocess.run([sys.executable, "-m", "bubblefree", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for option in ("--host", "--port", "--api-key", "--max-body-bytes", "--max-live", "--timeout", "--random",
                   "--log-level"):
        assert option in out.stdout


def test_random_takes_no_model():
    with pytest.raises(SystemExit) as err:
        main(["serve", "/some/model", "--random", "moondream-tiny"])
    assert err.value.code == 2


def test_serve_a_random_moondream_and_load_it_with_images():
    """``serve --random moondream-tiny`` on the CPU, as the load benchmark
    starts its servers: it answers point and query about fresh images under
    load, gets every request and page back, and stops cleanly on SIGINT."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bubblefree", "serve", "--random", "moondream-tiny",
                               "--device", "cpu", "--port", str(port), "--log-level", "warning",
                               "--max-live", "16"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert healthy(url, server, within_s=120) == "moondream2-random-tiny"
        for workload in ("point", "query"):
            result = load.main(["--url", url, "--workload", workload, "--images", "3", "--clients", "2",
                                "--requests", "6", "--duration", "60", "--leave", "0", "--max-tokens", "4"])
            assert all(result["checks"].values()) and not result["errors"], result
            assert result["completed"] == 6 and result["images_reused"] == 3
    finally:
        output = interrupt(server)
    assert server.returncode == 0, output


def test_serve_replicas_signals_interrupt_the_start_once_then_only_set_the_flag():
    """``serve --replicas``: its replicas answer before ``serve.run`` has
    returned, so a user's two Ctrl-C may both land in the start. The first
    interrupts it; the second, arriving while the first unwinds into the
    shutdown, must not raise into it (it did: exit -2, a traceback)."""
    from bubblefree.server.cli import StopSignals

    stop = StopSignals()
    with pytest.raises(KeyboardInterrupt):
        stop(2, None)
    stop(2, None)  # the second: the flag only
    assert stop.flag.is_set()
    serving = StopSignals()
    serving.started()
    serving(15, None)
    serving(2, None)
    assert serving.flag.is_set()


def test_ctrl_c_while_ray_starts_is_one_line_and_exit_130(monkeypatch, capsys):
    """Before ``serve --replicas`` sets its own handlers, Ctrl-C is Python's
    KeyboardInterrupt; in Ray's start (minutes, joining a cluster that does
    not answer) it was a traceback."""
    ray = pytest.importorskip("ray", reason="the ray extra: pip install bubblefree[ray]")
    from bubblefree.server import cli

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    shutdowns = []
    monkeypatch.setattr(ray, "init", interrupted)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    args = parser().parse_args(["serve", "--random", "moondream-tiny", "--replicas", "1"])
    assert cli.serve_replicas(args, cli.ServerSettings(), lambda: None) == 130
    assert capsys.readouterr().err == "bubblefree serve: interrupted while starting Ray\n"
    assert shutdowns == [1]


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_serve_stops_on_a_signal_closing_its_engine(signal_name):
    """uvicorn shuts down, then raises the signal again: SIGTERM's default
    ended the process there, before the engine closed. Both signals now end
    with the engine closed, exit 0 and no traceback."""
    import signal

    server = subprocess.Popen([sys.executable, "-m", "bubblefree", "serve", "--random", "moondream-tiny",
                               "--device", "cpu", "--port", str(free_port()), "--log-level", "warning"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        healthy(f"http://127.0.0.1:{server.args[server.args.index('--port') + 1]}", server, within_s=120)
        server.send_signal(getattr(signal, signal_name))
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, output
    assert output.rstrip().endswith("bubblefree serve: stopped") and "Traceback" not in output, output
