"""Two engine replicas on Ray Serve behind the relay (CPU, the fake engine):
both answer, the load is spread over both, a replica killed mid-request
fails its in-flight requests at once in the server's error shape (a 503
JSON error, or a last error event on a stream) while Ray Serve replaces it,
and a client that leaves frees its request on the replica. Ray's own start
is most of this file's time."""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra: pip install bubblefree[ray]")
from ray import serve  # noqa: E402

import server_support  # noqa: E402
from bubblefree.bench.load_checks import ROUND_S  # noqa: E402
from bubblefree.server import ServerSettings  # noqa: E402
from bubblefree.server.replicas import DEPLOYMENT, REPLICA_HEADER, application  # noqa: E402
from server_support import fake_engine, free_port  # noqa: E402


# A partial, not a function of this module: the replicas cannot import it.
slow_engine = functools.partial(fake_engine, endless=True, delay_s=0.02)


@pytest.fixture(scope="module")
def url():
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(server_support)  # the replicas cannot import the tests' helpers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=80 * 1024 * 1024)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(slow_engine, ServerSettings(), replicas=2, gpus=False, health_check_period_s=1.0),
                  name="bubblefree", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def ask(http: httpx.Client, url: str, tokens: int = 2) -> httpx.Response:
    return http.post(f"{url}/v1/query", json={"question": "what", "settings": {"max_tokens": tokens}})


def replicas_answering(url: str, requests: int = 24) -> set[str]:
    """The replicas that answered ``requests`` whole requests, sent four at a
    time: Ray's router sends one at a time to the replica with the shorter
    queue as it last saw them, which may be the same one for seconds (its
    queue lengths are cached); requests in flight together are spread."""
    from concurrent.futures import ThreadPoolExecutor

    with httpx.Client(trust_env=False, timeout=30) as http, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: ask(http, url), range(requests)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    return {r.headers[REPLICA_HEADER] for r in answers}


def test_both_replicas_answer(url):
    assert len(replicas_answering(url)) == 2


def kill(replica: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::bubblefree#{DEPLOYMENT}#{replica}", namespace="serve"),
             no_restart=True)


def wait_replaced(url: str, victim: str) -> None:
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        seen = replicas_answering(url, 12)
        if len(seen) == 2 and victim not in seen:
            break
        time.sleep(0.5)
    assert victim not in seen and len(seen) == 2


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_event_and_is_replaced(url):
    with httpx.Client(trust_env=False, timeout=30) as http:
        with http.stream("POST", f"{url}/v1/query", json={
                "question": "what", "stream": True, "settings": {"max_tokens": 200}}) as response:
            victim = response.headers[REPLICA_HEADER]
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            kill(victim)
            start = time.monotonic()
            rest = list(lines)  # the stream ends, it does not hang
            assert time.monotonic() - start < 5
    assert not any('"completed":true' in line for line in rest)
    assert "event: error" in rest
    error = json.loads(next(line for line in rest if line.startswith("data:") and '"error"' in line)[5:])
    assert error["error"]["param"] == "replica" and error["error"]["code"] == 503
    wait_replaced(url, victim)


def test_replicas_killed_mid_wait_answer_503_naming_the_replica(url):
    """Two requests waiting for their whole answer (~4 s each), one per
    replica as the router spreads them; both replicas die (which one holds
    a request is not visible before the answer, so both are killed)."""
    answers: list = []

    def wait_for_answer():
        with httpx.Client(trust_env=False, timeout=30) as http:
            response = ask(http, url, tokens=200)
            answers.append((response, time.monotonic()))

    waiting = [threading.Thread(target=wait_for_answer) for _ in range(2)]
    for t in waiting:
        t.start()
    time.sleep(1.0)  # both are decoding
    victims = [a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"SERVE_REPLICA::bubblefree#{DEPLOYMENT}#")]
    assert len(victims) == 2
    for victim in victims:
        kill(victim)
    killed = time.monotonic()
    for t in waiting:
        t.join(timeout=30)
    assert len(answers) == 2
    for response, at in answers:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["param"] == "replica"
        assert response.headers["retry-after"] == "1"
        assert at - killed < 5
    for victim in victims:
        wait_replaced(url, victim)


def test_a_client_that_leaves_through_the_relay_frees_its_request_on_the_replica(url):
    with httpx.Client(trust_env=False, timeout=30) as http:
        with http.stream("POST", f"{url}/v1/query", json={
                "question": "what", "stream": True, "settings": {"max_tokens": 250}}) as response:
            replica = response.headers[REPLICA_HEADER]
            assert next(line for line in response.iter_lines() if line.startswith("data:"))
        # The client has closed the connection mid-stream; the request would
        # run ~5 s more, so freed within 2.5 s means cancelled.
        deadline = time.monotonic() + 2.5
        stats = None
        while time.monotonic() < deadline:
            r = http.get(f"{url}/v1/stats")
            if r.headers[REPLICA_HEADER] == replica:
                stats = r.json()
                if stats["live_requests"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"]:
                    break
            time.sleep(0.1)
    assert stats is not None and stats["live_requests"] == 0
    assert stats["kv_pages"]["free"] == stats["kv_pages"]["total"]


def test_a_body_over_the_limit_is_refused_by_the_relay(url):
    with httpx.Client(trust_env=False, timeout=30) as http:
        r = http.post(f"{url}/v1/query", content=b"x" * (ServerSettings().max_body_bytes + 1),
                      headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_the_load_through_the_relay_is_checked_on_every_replica(url):
    """``bench.load --replicas 2`` against the relay: its ``/v1/stats``
    reads reach both replicas, the counts add up to what was sent (clients
    leaving early included), and asking for a third replica that is not
    there fails the check that names it instead of passing on two."""
    from bubblefree.bench import load
    common = ["--url", url, "--clients", "6", "--requests", "36", "--duration", "30", "--stream", "0.5",
              "--leave", "0.25", "--max-tokens", "6", "--settle", "15"]
    result = load.main([*common, "--replicas", "2"])
    assert all(result["checks"].values()), result["checks"]
    assert any(name.startswith("every replica read (2 of 2") for name in result["checks"]), result["checks"]
    # The allowance is the clients that left waiting, counted as the table counts them.
    assert any(name.endswith(f"; {result['left_wait']} left waiting)") for name in result["checks"]), result
    assert result["requests"] == 36 and not result["errors"], result
    assert result["checks"]["every replica read before the load (2 of 2)"]
    # Reads before and after for a round's full length (``ROUND_S``), past
    # Ray's 10-s cached queue lengths: in shorter ones its router may keep
    # every read on one replica, and the other's stale counts then fail the
    # count check too (seen once under a loaded CI host, with 0.5 and 1 s).
    missing = load.main([*common, "--requests", "4", "--leave", "0", "--replicas", "3",
                         "--settle", str(ROUND_S), "--ready", str(ROUND_S)])
    failed = [name for name, ok in missing["checks"].items() if not ok]
    assert failed == ["every replica read before the load (2 of 3)",
                      next(n for n in missing["checks"] if n.startswith("every replica read (2 of 3"))], failed


def test_clients_that_send_half_a_body_through_the_relay_leave_nothing_held(url):
    """Clients that promise a body and hang up halfway, mid-headers or
    before a byte of it: the relay and the replicas keep serving, and no
    replica is left with a live request or a page taken."""
    import socket
    import urllib.parse
    parts = urllib.parse.urlsplit(url)
    for sent in (b'{"question": "wh', b"", b"POST /v1/query HTTP/1.1\r\nContent-"):
        with socket.create_connection((parts.hostname, parts.port), timeout=5) as raw:
            if sent.startswith(b"POST"):
                raw.sendall(sent)
            else:
                raw.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 5000\r\n\r\n" + sent)
            time.sleep(0.2)
    assert len(replicas_answering(url, 12)) == 2  # both still serve whole requests
    seen: dict[str, dict] = {}
    # Past Ray's cached queue lengths (10 s), which may keep one replica off
    # the router's picks for one-at-a-time reads until they expire.
    deadline = time.monotonic() + 15
    with httpx.Client(trust_env=False, timeout=10) as http:
        while time.monotonic() < deadline:
            r = http.get(f"{url}/v1/stats")
            seen[r.headers[REPLICA_HEADER]] = r.json()
            if len(seen) == 2 and all(s["live_requests"] == 0 and s["kv_pages"]["free"] == s["kv_pages"]["total"]
                                      for s in seen.values()):
                break
            time.sleep(0.05)
    assert len(seen) == 2, seen
    for stats in seen.values():
        assert stats["live_requests"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"], stats
