"""``python -m bubblefree serve``: its options, and loopback by default."""

from __future__ import annotations

import subprocess
import sys

from bubblefree.server.cli import parser


def test_serve_defaults_to_loopback_on_moondreams_port():
    args = parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model) == ("127.0.0.1", 2020, None, None)


def test_python_dash_m_bubblefree_serve_help():
    out = subprocess.run([sys.executable, "-m", "bubblefree", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for option in ("--host", "--port", "--api-key", "--max-body-bytes", "--max-live", "--timeout"):
        assert option in out.stdout
