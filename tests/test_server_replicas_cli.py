"""``python -m bubblefree serve --replicas 2`` as a user runs it: Ray
started by the command, two replicas of a random moondream2 on the CPU
behind one address, both answering under load with every request and page
back on each, Ray's per-request logging silenced at ``--log-level
warning``, and a clean exit on SIGINT, twice in a row as a restless user
(or a supervisor's INT then TERM) sends it. Separate from
test_server_replicas.py, whose Ray runs inside the test process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="the ray extra: pip install bubblefree[ray]")

from bubblefree.bench import load  # noqa: E402
from server_support import free_port, healthy, interrupt  # noqa: E402


def test_serve_replicas_answers_on_both_and_stops_cleanly_on_repeated_signals():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "bubblefree", "serve", "--random", "moondream-tiny",
                               "--device", "cpu", "--port", str(port), "--log-level", "warning",
                               "--max-live", "16", "--replicas", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert healthy(url, server, within_s=240) == "moondream2-random-tiny"
        result = load.main(["--url", url, "--workload", "point", "--images", "4", "--clients", "4",
                            "--requests", "16", "--duration", "120", "--leave", "0.25", "--replicas", "2"])
        assert all(result["checks"].values()) and not result["errors"], result
        assert any(n.startswith("every replica read (2 of 2") for n in result["checks"]), result["checks"]
    finally:
        output = interrupt(server, times=2, within_s=60)
    assert server.returncode == 0, output
    assert "Traceback" not in output, output
    assert "CALL http" not in output and "disconnected, cancelling" not in output, output
