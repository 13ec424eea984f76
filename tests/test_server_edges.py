"""The server against what adversarial clients send: field names no UTF-8
can hold, stop strings of any length, prompts too long for the context,
the auth scheme in any case, unknown fields in content parts; a shutdown
or an engine that closes with requests in flight; and the count of
answers by status when the server itself fails."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_support import fake_engine, serving

from bubblefree.server.stops import MAX_STOP_CHARS, StopText


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=10).json()


@pytest.fixture
def engine():
    eng = fake_engine()
    yield eng
    eng.close()


def test_a_field_name_no_utf8_can_hold_is_refused_with_a_json_422(engine):
    """``"\\ud800"`` is valid JSON but a lone surrogate: the refusal quotes
    it, escaped, and the connection serves the next request. Rendered raw,
    the error handler failed and the client got a plain-text 500."""
    with serving(engine) as url, httpx.Client(base_url=url, timeout=10) as client:
        reply = client.post("/v1/query", content=b'{"question": "a", "\\ud800": 1}')
        assert reply.status_code == 422, reply.text
        assert reply.headers["content-type"] == "application/json"
        assert reply.json()["error"] == {"message": "\ud800: unknown field(s)", "type": "invalid_request_error",
                                         "param": "\ud800", "code": 422}
        assert client.post("/v1/query", json={"question": "what"}).status_code == 200  # same connection
        nested = client.post("/v1/query", content=b'{"question": "a", "settings": {"\\udc80": 1}}')
        assert nested.status_code == 422 and nested.json()["error"]["param"] == "settings.\udc80"
        assert stats(url)["requests_by_status"] == {"200": 1, "422": 2}


def test_a_stop_string_past_the_limit_is_refused_naming_stop_and_nothing_waits_on_it(engine):
    with serving(engine) as url:
        for stop in ("x" * (MAX_STOP_CHARS + 1), ["a", "x" * 300_000]):
            reply = httpx.post(f"{url}/v1/completions", timeout=20,
                               json={"prompt": "a", "max_tokens": 7, "stop": stop})
            assert reply.status_code == 422 and reply.json()["error"]["param"] == "stop", reply.text
            assert f"at most {MAX_STOP_CHARS} characters" in reply.json()["error"]["message"]
        at_limit = httpx.post(f"{url}/v1/completions", timeout=20,
                              json={"prompt": "a", "max_tokens": 7, "stop": "t" * MAX_STOP_CHARS})
        assert at_limit.status_code == 200 and at_limit.json()["choices"][0]["text"] == "the cat sits on the mat ."


def first_stop(text: str, stops: list[str]) -> str:
    """The text before the first stop string to be complete, read a
    character at a time (of two complete at once, the longer)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))]
    return text


@given(st.lists(st.text("abc", max_size=6), max_size=8),
       st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=4))
def test_stop_text_cuts_before_the_first_stop_to_complete_however_the_text_is_split(pieces, stops):
    cut = StopText(tuple(stops))
    out = "".join(cut.push(p) for p in pieces) + cut.flush()
    text = "".join(pieces)
    assert out == first_stop(text, stops)
    assert cut.stopped == any(s in text for s in stops)


def test_where_the_pieces_break_never_moves_the_cut():
    """A longer stop string starting earlier but completing later does not
    win over one complete first, in one piece or two."""
    for pieces in (["abb"], ["ab", "b"], ["a", "b", "b"]):
        cut = StopText(("abb", "b"))
        assert "".join(cut.push(p) for p in pieces) + cut.flush() == "a"


@pytest.mark.parametrize("route,body,field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the " * 300}]}, "messages"),
    ("/v1/query", {"question": "the " * 300}, "question"),
    ("/v1/completions", {"prompt": "the " * 300}, "prompt"),
])
def test_a_prompt_too_long_names_the_clients_field(engine, route, body, field):
    """The engine names its own ``prompt``; the client sent ``messages`` (chat)
    or ``question`` (Moondream's query)."""
    with serving(engine) as url:
        reply = httpx.post(url + route, json=body, timeout=20)
        assert reply.status_code == 422
        error = reply.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}: "), reply.text


def _in_flight_during(close, stream: bool) -> dict:
    """A long chat request, then ``close(stop_server, engine)`` while it
    runs; the reply's status, content type and (non-empty) lines."""
    eng = fake_engine(script=("cat",), endless=True, delay_s=0.03)
    got = {}
    server = serving(eng)
    url = server.__enter__()
    try:
        def ask():
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
                        "messages": [{"role": "user", "content": "a"}], "max_tokens": 200,
                        "stream": stream}) as reply:
                    got["status"], got["type"] = reply.status_code, reply.headers.get("content-type")
                    got["lines"] = [line for line in reply.iter_lines() if line]
            except httpx.HTTPError as err:
                got["error"] = err
        t = threading.Thread(target=ask)
        t.start()
        time.sleep(0.4)
        close(lambda: server.__exit__(None, None, None), eng)
        t.join(30)
    finally:
        server.__exit__(None, None, None)
        eng.close()
    assert not t.is_alive() and "error" not in got, got
    return got


def _shut_down(stop_server, eng):
    stop_server()  # uvicorn cancels what still runs once its grace period ends


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_cut_by_the_servers_shutdown_gets_a_503_in_the_apis_shape(stream):
    got = _in_flight_during(_shut_down, stream)
    if not stream:
        assert got["status"] == 503 and got["type"] == "application/json", got
        error = json.loads(got["lines"][0])["error"]
    else:  # the stream had begun: its last events say why it ends
        assert got["status"] == 200 and got["lines"][-1] == "data: [DONE]", got
        error = json.loads(got["lines"][-2].removeprefix("data: "))["error"]
    assert (error["code"], error["param"]) == (503, "server") and "shutting down" in error["message"]


def _close_engine(stop_server, eng):
    eng.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_engine_closes_gets_a_503_naming_the_engine(stream):
    got = _in_flight_during(_close_engine, stream)
    if not stream:
        assert got["status"] == 503, got
        error = json.loads(got["lines"][0])["error"]
    else:
        assert got["lines"][-1] == "data: [DONE]", got
        error = json.loads(got["lines"][-2].removeprefix("data: "))["error"]
    assert (error["code"], error["param"]) == (503, "engine") and "cancelled" in error["message"]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(engine, scheme):
    with serving(engine, api_key="k") as url:
        reply = httpx.post(f"{url}/v1/query", json={"question": "a"},
                           headers={"Authorization": f"{scheme} k"})
        assert reply.status_code == 200, reply.text
        wrong = httpx.post(f"{url}/v1/query", json={"question": "a"},
                           headers={"Authorization": f"{scheme} j"})
        assert wrong.status_code == 401


@pytest.mark.parametrize("part,field", [
    ({"type": "text", "text": "a", "txet": 1}, "txet"),
    ({"type": "text", "text": "a", "image_url": {"url": "x"}}, "image_url"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "text": "a"}, "text"),
])
def test_unknown_fields_in_a_content_part_are_refused(engine, part, field):
    with serving(engine) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=20,
                           json={"messages": [{"role": "user", "content": [part]}]})
        assert reply.status_code == 422, reply.text
        assert reply.json()["error"]["param"] == f"messages[0].content[0].{field}"


def test_a_route_that_raises_is_a_json_500_counted_as_a_server_error_not_a_client_that_left(engine, monkeypatch):
    """Starlette's error middleware answers an escaped exception outside
    the guard that counts answers, in the one JSON shape; the guard records
    it as 500."""
    from bubblefree.server import moondream_api

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(moondream_api, "run_skill", broken)
    with serving(engine) as url:
        reply = httpx.post(f"{url}/v1/query", json={"question": "a"}, timeout=10)
        assert reply.status_code == 500 and reply.headers["content-type"] == "application/json"
        assert reply.json()["error"] == {
            "message": "server: an internal error (RuntimeError); the request did not complete",
            "type": "server_error", "param": "server", "code": 500}
        assert stats(url)["requests_by_status"] == {"500": 1}


def test_a_body_that_stops_arriving_is_answered_408_and_the_server_serves_on(engine):
    """A client that sends part of its body and goes quiet held its
    connection (and a route's task) for ever."""
    import socket

    with serving(engine, body_timeout_s=0.5) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"question\": ")
            started = time.monotonic()
            reply = sock.recv(65536).decode()
            waited = time.monotonic() - started
        assert reply.startswith("HTTP/1.1 408"), reply
        body = json.loads(reply.split("\r\n\r\n", 1)[1])
        assert body["error"]["param"] == "body" and "not received within 0.5 s" in body["error"]["message"]
        assert waited < 10
        assert httpx.post(f"{url}/v1/query", json={"question": "what"}, timeout=10).status_code == 200
        assert stats(url)["requests_by_status"] == {"408": 1, "200": 1}
