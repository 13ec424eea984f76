"""``bench.load`` against a server on the fake engine: many clients, some
leaving mid-stream or mid-wait; the server counts every request once and
gets every KV page and row slot back; the table is written. And the checks
can fail: a request still live is reported."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bubblefree.bench import load
from server_support import fake_engine, serving


def test_load_with_early_leavers_settles_and_writes_its_table(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Speed benchmarks\n\nearlier runs stay\n")
    with fake_engine(endless=True, delay_s=0.002, num_pages=64, max_rows=4) as engine, serving(engine) as url:
        result = load.main(["--url", url, "--clients", "8", "--requests", "60", "--duration", "20",
                            "--stream", "0.5", "--leave", "0.3", "--max-tokens", "8", "--out", str(doc)])
    assert all(result["checks"].values()), result["checks"]
    assert result["requests"] == 60 and not result["errors"], result
    assert result["left_stream"] > 0 and result["left_wait"] > 0  # both ways of leaving were tried
    assert result["completed"] + result["left_stream"] + result["left_wait"] == 60
    assert result["ttft_ms"][0] is not None and result["latency_ms"][1] >= result["latency_ms"][0]
    written = doc.read_text()
    assert "earlier runs stay" in written and written.count(load.BEGIN) == 1
    assert "| check after the load | holds |" in written and "**no**" not in written


def test_a_request_still_live_fails_the_checks():
    """A request the load did not send is live on the server: the settle
    check must report it (and the count), not wait it out as a pass."""
    with fake_engine(endless=True, delay_s=0.01) as engine, serving(engine, request_timeout_s=30) as url:
        async def go():
            async with httpx.AsyncClient(trust_env=False) as http:
                stats = load.Stats(http, url)
                await stats.read()
                hung = asyncio.ensure_future(http.post(f"{url}/v1/query", json={
                    "question": "what", "settings": {"max_tokens": 200}}, timeout=30))
                await asyncio.sleep(0.3)
                result = await load.settle(stats, sent=0, within_s=0.3)
                hung.cancel()
                await asyncio.gather(hung, return_exceptions=True)
                return result
        result = asyncio.run(go())
    failed = [name for name, ok in result.items() if not ok]
    assert any(n.startswith("no request still live (1)") for n in failed), result
    assert any(n.startswith("every row slot free again") for n in failed), result


def test_only_loopback_is_loaded():
    with pytest.raises(SystemExit, match="loopback"):
        load.main(["--url", "http://10.0.0.1:2020", "--requests", "1"])
