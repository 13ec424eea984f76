"""The server under clients that leave, too many requests, slow requests,
wrong keys and oversized or cut bodies: each gets its answer, the engine's
pages come back, and the server keeps serving."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server_support import fake_engine, serving

SLOW = {"script": ("cat",), "endless": True, "delay_s": 0.01}  # ~10 ms a token, never ends by itself
QUERY = {"question": "what", "settings": {"max_tokens": 200}}


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats").json()


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def pages_back(url: str) -> bool:
    s = stats(url)
    return s["kv_pages"]["free"] == s["kv_pages"]["total"] and s["live_requests"] == 0


@pytest.fixture
def slow():
    engine = fake_engine(**SLOW)
    yield engine
    engine.close()


def test_a_streaming_client_that_leaves_frees_its_pages(slow):
    with serving(slow) as url:
        with httpx.Client(timeout=10) as client:
            with client.stream("POST", f"{url}/v1/query", json={**QUERY, "stream": True}) as reply:
                lines = reply.iter_lines()
                assert next(lines).startswith("data: ")
                during = stats(url)
        assert during["kv_pages"]["free"] < during["kv_pages"]["total"] and during["live_requests"] == 1
        wait_for(lambda: pages_back(url), timeout=5)


def test_how_each_stream_ended_is_counted(slow):
    """A stream's 200 goes out with its first bytes, so a client that left
    mid-stream was counted as answered like one that read to the end, and
    a stream cut by its deadline likewise: how streams end was nowhere.
    Now ``/v1/stats`` and ``/metrics`` count them by how they ended."""
    with serving(slow, request_timeout_s=0.5) as url, httpx.Client(timeout=10) as client:
        short = client.post(f"{url}/v1/query", json={"question": "a", "stream": True,
                                                     "settings": {"max_tokens": 2}})
        assert short.status_code == 200 and short.text.endswith("\n\n")
        with client.stream("POST", f"{url}/v1/query", json={**QUERY, "stream": True}) as reply:
            assert next(reply.iter_lines()).startswith("data: ")
        wait_for(lambda: pages_back(url), timeout=5)
        cut = client.post(f"{url}/v1/query", json={**QUERY, "stream": True}).text.split("\n\n")
        assert '"code":504' in cut[-2]
        expected = {"finished": 1, "client_left": 1, "deadline": 1}
        wait_for(lambda: stats(url)["streams_ended"] == expected)
        metrics = client.get(f"{url}/metrics").text
        for how, count in expected.items():
            assert f'bubblefree_streams_ended_total{{how="{how}"}} {count:.1f}' in metrics, metrics


def test_a_waiting_client_that_leaves_frees_its_pages(slow):
    with serving(slow) as url:
        port = int(url.rsplit(":", 1)[1])
        body = b'{"question": "what", "settings": {"max_tokens": 200}}'
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: stats(url)["kv_pages"]["free"] < stats(url)["kv_pages"]["total"])
        wait_for(lambda: pages_back(url), timeout=5)  # long before its 200 tokens could have run
        wait_for(lambda: stats(url)["requests_by_status"].get("499") == 1)


def _head_and_body(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_pipelines_a_request_then_leaves_frees_the_running_ones_pages(slow, stream):
    """uvicorn stops reading once a request waits behind a running one, so it
    never saw such a client leave, and told only the waiting request when
    it did: the running one held its slot and its pages until its deadline
    (300 s by default), one connection enough to hold the whole KV cache."""
    with serving(slow) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(_head_and_body({**QUERY, "stream": stream}))
            wait_for(lambda: stats(url)["live_requests"] == 1)
            raw.sendall(_head_and_body(QUERY))  # pipelined behind the running one
            time.sleep(0.3)
            assert stats(url)["live_requests"] == 1  # the second waits its turn, unadmitted
        wait_for(lambda: pages_back(url), timeout=5)  # long before its 200 tokens or its deadline
        if stream:
            wait_for(lambda: stats(url)["streams_ended"] == {"client_left": 1})
        else:
            wait_for(lambda: stats(url)["requests_by_status"].get("499") == 1)
        answered = httpx.post(f"{url}/v1/query", json={"question": "a", "settings": {"max_tokens": 2}})
        assert answered.json()["answer"] == "cat cat"


def test_past_the_live_bound_requests_get_429_with_retry_after(slow):
    with serving(slow, max_live=1, retry_after_s=3) as url, httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{url}/v1/query", json={**QUERY, "stream": True}) as first:
            lines = first.iter_lines()  # held: a dropped line iterator closes the response
            assert next(lines).startswith("data: ")
            assert stats(url)["live_requests"] == 1
            refused = client.post(f"{url}/v1/query", json=QUERY)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        wait_for(lambda: pages_back(url))
        answered = client.post(f"{url}/v1/query", json={"question": "a", "settings": {"max_tokens": 2}})
        assert answered.json()["answer"] == "cat cat"


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "the cat " * 200_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the cat " * 200_000}]}),
])
def test_past_the_live_bound_an_openai_request_is_refused_before_it_is_tokenized(slow, monkeypatch,
                                                                                  route, body):
    """The OpenAI routes tokenized their prompt before asking for a live
    slot: a request past the bound took seconds of tokenizing (for a 16 MB
    prompt) to be told 429, and such requests' tokenizing was not bounded by
    ``--max-live`` at all. Now nothing is tokenized for a request refused."""
    kind, calls = type(slow.skills.tokenizer), []
    real = kind.encode
    monkeypatch.setattr(kind, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    with serving(slow, max_live=1) as url, httpx.Client(timeout=20) as client:
        with client.stream("POST", f"{url}/v1/query", json={**QUERY, "stream": True}) as first:
            lines = first.iter_lines()  # held: a dropped line iterator closes the response
            assert next(lines).startswith("data: ")  # the one live slot, held
            assert stats(url)["live_requests"] == 1
            calls.clear()
            refused = client.post(f"{url}{route}", json={**body, "max_tokens": 2})
            assert refused.status_code == 429, refused.text
            assert calls == []
        wait_for(lambda: pages_back(url))
        admitted = client.post(f"{url}{route}", json={**body, "max_tokens": 2})
        assert calls  # tokenized once admitted: longer than the context, refused naming it
        assert admitted.status_code == 422 and "max_context is 256" in admitted.json()["error"]["message"]
        assert client.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_a_request_past_its_deadline_gets_504_and_is_cancelled(slow):
    with serving(slow, request_timeout_s=0.3) as url, httpx.Client(timeout=10) as client:
        started = time.monotonic()
        reply = client.post(f"{url}/v1/chat/completions",
                            json={"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "a"}]})
        assert reply.status_code == 504 and time.monotonic() - started < 1.5
        wait_for(lambda: pages_back(url), timeout=2)
        events = client.post(f"{url}/v1/query", json={**QUERY, "stream": True}).text.split("\n\n")
        assert '"code":504' in events[-2] and '"completed":true' in events[-2]
        wait_for(lambda: pages_back(url), timeout=2)


def test_the_api_key_is_asked_for_everywhere_but_health():
    engine = fake_engine()
    with serving(engine, api_key="k") as url, httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}):
            reply = client.post("/v1/query", json={"question": "a"}, headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["param"] == "authorization"
            assert client.get("/v1/stats", headers=headers).status_code == 401
        ok = client.post("/v1/query", json={"question": "a"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
    engine.close()


def test_oversized_bodies_get_413_with_or_without_a_length():
    engine = fake_engine()
    with serving(engine, max_body_bytes=1000) as url, httpx.Client(base_url=url, timeout=10) as client:
        big = b'{"question": "' + b"a" * 2000 + b'"}'
        assert client.post("/v1/query", content=big).status_code == 413
        chunked = client.post("/v1/query", content=iter([big[:600], big[600:]]))  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["param"] == "body"
        assert client.post("/v1/query", json={"question": "what"}).status_code == 200
    engine.close()


@pytest.mark.parametrize("route,fields", [
    ("/v1/query", {"question": "what", "spatial_refs": [[0.5, 0.5]] * 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 3}),
])
def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed(route, fields):
    """The parser holds the event loop: a 20 MB body of small numbers held
    every other client for seconds. Past ``max_json_values`` (counted by
    commas) the body is refused unparsed; at it, it is read as before."""
    engine = fake_engine()
    commas = json.dumps(fields).count(",")
    with serving(engine, max_json_values=commas) as url, httpx.Client(base_url=url, timeout=10) as client:
        refused = client.post(route, json=fields)
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert error["param"] == "body"
        assert error["message"] == (f"body: more than this server's limit of {commas} JSON values "
                                    f"({commas} commas)")
        assert client.post(route, json={**fields, "stream": "no"}).status_code == 413
        assert client.post(route, json=fields).status_code == 413
        ok = client.post("/v1/query", json={"question": "what"})
        assert ok.status_code == 200, ok.text
        assert stats(url)["requests_by_status"]["413"] == 3
    with serving(engine, max_json_values=commas + 1) as url:
        reply = httpx.post(f"{url}{route}", json=fields, timeout=10)
        assert reply.status_code != 413, reply.text  # read, whatever the route then answers
    engine.close()


def test_a_client_that_sends_half_a_body_leaves_the_server_serving():
    engine = fake_engine()
    with serving(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                        b'{"question": "wh')
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(5)
            answer = raw.recv(4096)  # the server answers 400 or just closes; it must not hang
            assert answer == b"" or answer.startswith(b"HTTP/1.1 400")
        assert httpx.post(f"{url}/v1/query", json={"question": "what"}).status_code == 200
        assert pages_back(url)
    engine.close()


def test_health_stats_and_metrics_report_the_engine():
    engine = fake_engine(num_pages=32)
    engine.pipelined = "auto"
    with serving(engine) as url, httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/health").json()["status"] == "ok"
        client.post("/v1/query", json={"question": "what"})
        client.post("/v1/query", json={"question": 1})
        s = client.get("/v1/stats").json()
        assert s["requests_by_status"] == {"200": 2, "422": 1}  # /health, the query; the refusal
        assert s["kv_pages"] == {"free": 32, "total": 32} and s["row_slots"]["free"] == s["row_slots"]["total"]
        ticks = s["auto_ticks"]
        assert s["pipelined"] == "auto" and ticks == {"ahead": engine.core.ahead_ticks,
                                                      "behind": engine.core.behind_ticks,
                                                      "unweighed": engine.core.unweighed_ticks}
        assert ticks["ahead"] + ticks["behind"] > 0
        metrics = client.get("/metrics").text
        for choice, n in ticks.items():
            assert f'bubblefree_auto_ticks_total{{choice="{choice}"}} {float(n)}' in metrics
        assert 'bubblefree_http_requests_total{route="/v1/query",status="200"} 1.0' in metrics
        assert 'bubblefree_http_requests_total{route="/v1/query",status="422"} 1.0' in metrics
        assert "bubblefree_kv_pages_free 32.0" in metrics and "bubblefree_queue_depth 0.0" in metrics
        assert 'bubblefree_tokens_total{kind="completion"} 7.0' in metrics
    engine.close()
