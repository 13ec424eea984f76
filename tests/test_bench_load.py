"""``bench.load`` against a server on the fake engine: many clients, some
leaving mid-stream or mid-wait; the server counts every request once and
gets every KV page and row slot back; the table is written. And the checks
can fail: a request still live is reported. Against two servers, the
clients are spread (client i to server i mod 2) and each server is checked
on its own; the grid and its comparison are in test_bench_load_grid.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

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


def test_req_s_counts_what_ended_within_the_duration():
    """Time ended the cell: the requests still running at its end count in
    latency but not in req/s. The request count ended it: all over the wall."""
    def done(at):
        return load.Outcome(load.Plan(stream=False, leave=False), latency_s=0.1, ended=at)
    outcomes = [done(100.5), done(101.9), done(102.4), load.Outcome(load.Plan(stream=False, leave=True))]
    timed = load.Load(url="u", requests=100, duration_s=2.0)
    assert load.window(timed, outcomes, start=100.0, wall=2.6) == (2, 2.0)
    counted = load.Load(url="u", requests=4, duration_s=60.0)
    assert load.window(counted, outcomes, start=100.0, wall=2.6) == (3, 2.6)
    assert load.summary(timed, outcomes, 2.6, "m", (2, 2.0))["req_s"] == 1.0


# -- several servers ---------------------------------------------------------

def test_clients_spread_across_servers_each_checked_on_its_own():
    """Client i asks server i mod 2: with 3 clients the first server holds 2
    and the second 1, the requests split alike, and each server's own
    counters agree with what was sent to it."""
    with fake_engine(delay_s=0.002) as one, fake_engine(delay_s=0.002) as two, \
            serving(one) as a, serving(two) as b:
        result = load.main(["--url", a, "--url", b, "--clients", "3", "--requests", "45", "--duration", "20",
                            "--stream", "0.5", "--leave", "0.2", "--max-tokens", "6"])
    assert [(s["url"], s["clients"], s["requests"]) for s in result["servers"]] == [(a, 2, 30), (b, 1, 15)]
    assert all(result["checks"].values()), result["checks"]
    for url, sent in ((a, 30), (b, 15)):
        counted = f"{url}: every request sent was counted once by the server ({sent} of {sent})"
        assert result["checks"][counted]
    assert len(result["checks"]) == 10 and len(result["load_cpu"]) == 2
    assert result["requests"] == 45 and not result["errors"], result
    assert result["completed"] + result["left_stream"] + result["left_wait"] == 45


def test_an_address_given_twice_is_loaded_by_two_processes_and_checked_once_for_both():
    """Two load processes against one address (as in front of Ray Serve's
    replicas): the address's counters are checked once, against what both
    sent, and a check that each process made alone (counting the other's
    requests as extra) would have failed."""
    with fake_engine(delay_s=0.002) as engine, serving(engine) as url:
        result = load.main(["--url", url, "--url", url, "--clients", "4", "--requests", "40", "--duration", "20",
                            "--stream", "0.5", "--leave", "0.2", "--max-tokens", "6"])
    assert [(s["url"], s["clients"], s["requests"]) for s in result["servers"]] == [(url, 2, 20), (url, 2, 20)]
    assert len(result["checks"]) == 5 and len(result["load_cpu"]) == 2, result["checks"]
    assert result["model"] != "?"  # read once by the checker, not by the processes
    assert result["checks"][f"{url}: every request sent was counted once by the server (40 of 40)"]
    assert all(result["checks"].values()), result["checks"]


def test_a_server_left_with_a_live_request_fails_only_its_own_checks():
    from bubblefree.bench.load_spread import Spread

    with fake_engine(delay_s=0.001) as one, fake_engine(endless=True, delay_s=0.05) as two, \
            serving(one) as a, serving(two, request_timeout_s=60) as b, Spread([a, b]) as spread:
        with _hung_query(b):  # live on b through the whole cell
            result = spread.run(load.Load(url=a, clients=2, requests=8, duration_s=10, stream=0.0, leave=0.0,
                                          max_tokens=4, settle_s=0.3))
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert failed and all(name.startswith(f"{b}: ") for name in failed), result["checks"]
    assert f"{b}: no request still live (1)" in failed
    assert all(ok for name, ok in result["checks"].items() if name.startswith(f"{a}: "))


@contextlib.contextmanager
def _hung_query(url: str):
    """A query sent on a bare socket, live until the block ends (the socket
    closes: the server cancels it)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({"question": "what", "settings": {"max_tokens": 200}}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: load\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        time.sleep(0.3)
        yield


def test_clients_and_requests_are_shared_out_in_proportion():
    from bubblefree.bench.load_spread import shares, split

    assert shares(3, 2) == [2, 1] and shares(1, 2) == [1, 0] and shares(128, 2) == [64, 64]
    assert split(45, [2, 1]) == [30, 15] and split(5, [1, 0]) == [5, 0] and split(0, [1, 1]) == [0, 0]
    parts = split(7, [1, 1, 1])
    assert sum(parts) == 7 and max(parts) - min(parts) == 1


# -- workloads and images ----------------------------------------------------

def test_a_point_asks_whole_with_its_image_and_a_query_as_asked():
    image = "data:image/jpeg;base64,AAAA"
    point = load.body(load.Load(url="u", workload="point"), load.Plan(stream=True, leave=False), image)
    assert point == {"object": load.OBJECT, "settings": {"temperature": 0.0, "max_objects": 1}, "image_url": image}
    query = load.body(load.Load(url="u", max_tokens=10), load.Plan(stream=True, leave=False), None)
    assert query == {"question": load.QUESTION, "stream": True, "settings": {"max_tokens": 10, "temperature": 0.0}}
    # The same seed gives point the same leavers, and no streams.
    query_plans = list(load.plans(load.Load(url="u", requests=50, stream=0.5, leave=0.3)))
    point_plans = list(load.plans(load.Load(url="u", workload="point", requests=50, stream=0.5, leave=0.3)))
    assert any(p.stream for p in query_plans) and not any(p.stream for p in point_plans)
    assert [p.leave for p in query_plans] == [p.leave for p in point_plans]


def test_the_images_are_different_and_read_as_the_server_reads_them():
    from bubblefree.bench.load_images import pool
    from bubblefree.server.images import check_image

    uris = pool(4, 378, seed=1)
    assert len(set(uris)) == 4 and all(u.startswith("data:image/jpeg;base64,") for u in uris)
    pictures = [check_image(u, "image_url", True, 10**7) for u in uris]
    assert all(p.size == (378, 378) and p.mode == "RGB" for p in pictures)
    assert pool(4, 378, seed=1) == uris and pool(1, 378, seed=2)[0] not in uris


def _snapshot(total: int) -> dict:
    return {"requests_by_status": {"200": total}, "live_requests": 0, "queue_depth": 0,
            "kv_pages": {"free": 8, "total": 8}, "row_slots": {"free": 2, "total": 2}}


@pytest.mark.parametrize("counted, holds", [(10, True), (9, True), (8, False), (11, False)])
def test_behind_a_relay_only_clients_that_left_waiting_may_be_missing_from_the_count(counted, holds):
    """Two replicas answered the reads (three reads on ``a``, one on ``b``):
    their counts add up, less the checker's own reads; of 10 sent, one
    client left waiting, so 9 or 10 counted holds and nothing else does."""
    from bubblefree.bench.load_checks import Seen
    stats = load.Stats(None, "http://127.0.0.1:1", replicas=2)
    stats.seen = {"a": Seen(_snapshot(100), _snapshot(100 + 2 + counted - 4), calls=3),
                  "b": Seen(_snapshot(50), _snapshot(54), calls=1)}
    stats.fresh = 2
    result = load.checks(stats, sent=10, left_waiting=1)
    name = next(n for n in result if n.startswith("every request sent"))
    assert result[name] is holds and f"({counted} of 10; 1 left waiting)" in name, result
    assert all(ok for n, ok in result.items() if n != name)
    one = load.Stats(None, "http://127.0.0.1:1")  # no relay: one server, whose count must be exact
    one.seen = {"": Seen(_snapshot(0), _snapshot(counted), calls=1)}
    exact = load.checks(one, sent=10, left_waiting=1)
    assert exact[f"every request sent was counted once by the server ({counted} of 10)"] is (counted == 10)


class _Relay:
    """A relay in front of replicas ``a`` and ``b`` where ``b`` answers only
    from its ``b_from``-th call on (still starting before), as Ray's proxy
    routes nothing to a replica that is not up."""

    def __init__(self, b_from: int | None):
        self.calls, self.b_from = 0, b_from

    async def get(self, url: str):
        import httpx
        self.calls += 1
        up_b = self.b_from is not None and self.calls >= self.b_from
        name = "b" if up_b and self.calls % 2 == 0 else "a"
        return httpx.Response(200, json=_snapshot(0), headers={"x-bubblefree-replica": name},
                              request=httpx.Request("GET", url))


def test_the_reads_before_the_load_wait_for_a_replica_still_starting():
    """Counted from a later first read, a late replica's early requests would
    be missing: the checker waits for every replica before the load, and
    says how many it reached when one never came."""
    import asyncio
    stats = load.Stats(_Relay(b_from=150), "http://127.0.0.1:1", replicas=2)  # b up after 3 rounds
    asyncio.run(stats.read_all(within_s=30))
    assert stats.before == 2 and set(stats.seen) == {"a", "b"}
    assert load.checks(stats, sent=0)["every replica read before the load (2 of 2)"] is True
    never = load.Stats(_Relay(b_from=None), "http://127.0.0.1:1", replicas=2)
    asyncio.run(never.read_all(within_s=0.3))
    assert never.before == 1
    result = load.checks(never, sent=0)
    assert result["every replica read before the load (1 of 2)"] is False
    one = load.Stats(_Relay(b_from=None), "http://127.0.0.1:1")  # one replica asked for: one read
    asyncio.run(one.read_all(within_s=30))
    assert one.before == 1 and one.calls == 1
    assert not any("before the load" in n for n in load.checks(one, sent=0))
