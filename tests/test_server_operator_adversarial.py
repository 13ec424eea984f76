"""The server's machinery against a hostile operator and hostile clients:
a shutdown that cuts a request before its answer began, a stream whose
reader stops reading, a client that leaves mid-body, an engine that dies
under its probe, a bug mid-stream, and settings no server can keep.

Each holds the promises of docs/server.md: every request answered in the
one JSON shape (or counted 499 where its client left), counted once, its
admission slot and engine request given back however it ended."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Iterator

import httpx
import pytest
import uvicorn

from bubblefree import Engine
from bubblefree.core import Engine as CoreEngine
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.images import pillow_max_pixels
from bubblefree.server import ServerSettings, cli, create_app, http_protocol, watch
from bubblefree.skills import SkillSet
from server_support import TOKENIZER, fake_engine, serving


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=10).json()


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def cat_engine(*, broken: threading.Event | None = None, delay_s: float = 0.0, **backend: object) -> Engine:
    """An engine that answers "cat" until its budget runs out; with
    ``broken`` set, its model raises (a lost device), which stops the engine."""
    cat, vocab = TOKENIZER.encode("cat")[0], len(TOKENIZER)

    def scores(prompt: tuple[int, ...], position: int, prev: int) -> list[float]:
        if delay_s:
            time.sleep(delay_s)
        if broken is not None and broken.is_set():
            raise RuntimeError("the device fell off the bus")
        return [1.0 if t == cat else 0.0 for t in range(vocab)]

    model = FakeModel(vocab_size=vocab, eos_id=TOKENIZER.eos_id, score_fn=scores)
    core = CoreEngine(FakeBackend(model=model, images=False, values=False, **backend))
    return Engine(core, SkillSet(TOKENIZER, core.register_mask, codec=None).compile_all())


@contextlib.contextmanager
def served_on(listener: socket.socket, app, settings: ServerSettings,
              grace_s: float = 2.0) -> Iterator[tuple[str, uvicorn.Server]]:
    """``app`` served on ``listener`` (a socket the test shaped) in a thread."""
    server = uvicorn.Server(uvicorn.Config(app, http=http_protocol(settings), log_level="critical",
                                           timeout_graceful_shutdown=grace_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(15)


def listening(send_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if send_buffer is not None:  # accepted connections inherit it: a small one fills at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    return sock


def post_head(route: str, length: int) -> bytes:
    return (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_all(sock: socket.socket, within_s: float) -> bytes:
    sock.settimeout(within_s)
    got = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(1 << 16):
            got += chunk
    return got


def test_a_request_the_shutdown_cuts_before_its_answer_began_gets_the_json_503_counted_as_503():
    """uvicorn cancels what still runs once its grace period ends. Only a
    request waiting on the engine turned that into the documented 503: one
    still reading its body (or decoding its image, or tokenizing) got
    uvicorn's plain-text 500, and was counted as a client that left (499)."""
    engine = fake_engine()
    listener = listening()
    settings = ServerSettings(port=listener.getsockname()[1])
    app = create_app(engine, settings)
    try:
        with served_on(listener, app, settings, grace_s=0.5) as (url, server):
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(post_head("/v1/query", 100) + b'{"question": ')  # the rest never comes
                wait_for(lambda: server.server_state.tasks)
                server.should_exit = True
                reply = read_all(sock, within_s=10).decode()
        head, _, body = reply.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 503"), reply
        assert "retry-after: 1" in head.lower() and "application/json" in head, head
        error = json.loads(body)["error"]
        assert (error["code"], error["param"]) == (503, "server") and "shutting down" in error["message"]
        observer, admission = app.state.served.observer, app.state.served.admission
        assert dict(observer.by_status) == {503: 1} and admission.live == 0
    finally:
        engine.close()


def test_a_stream_whose_reader_stops_reading_gives_back_its_slot_and_request_at_the_deadline():
    """A client that stops reading a stream fills the connection's buffers;
    the stream's next write waits for it. At the deadline the pump was
    cancelled, but the slot was given back (and the engine request
    cancelled) only after the 504 event was written, which waited on the
    same reader: the slot was held for as long as the client stayed, and
    ``--max-live`` such clients locked every other one out (429)."""
    engine = cat_engine(num_pages=1024, max_context=4000, zero_cost=True)
    listener = listening(send_buffer=4096)
    settings = ServerSettings(port=listener.getsockname()[1], request_timeout_s=2.5, max_live=1)
    try:
        with served_on(listener, create_app(engine, settings), settings) as (url, server):
            port = int(url.rsplit(":", 1)[1])
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
                sock.connect(("127.0.0.1", port))
                body = json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 3000,
                                   "stream": True}).encode()
                sock.sendall(post_head("/v1/chat/completions", len(body)) + body)  # then reads nothing
                wait_for(lambda: stats(url)["live_requests"] == 1)
                started = time.monotonic()
                wait_for(lambda: stats(url)["live_requests"] == 0, timeout=5)
                assert time.monotonic() - started < 4.5  # the deadline, not the client, ended it
                s = stats(url)
                assert s["kv_pages"]["free"] == s["kv_pages"]["total"]
                answered = httpx.post(f"{url}/v1/query", json={"question": "a", "settings": {"max_tokens": 2}})
                assert answered.status_code == 200, answered.text
                # Its last events wait a bounded time for the reader, then the server gives up on it.
                wait_for(lambda: not server.server_state.tasks, timeout=watch.TAIL_S + 3)
    finally:
        engine.close()


def query_counts(url: str) -> dict[str, float]:
    """``/metrics``' answers to ``/v1/query``, by status."""
    prefix = 'bubblefree_http_requests_total{route="/v1/query",status="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{url}/metrics").text.splitlines() if line.startswith(prefix)}


def test_a_client_that_leaves_before_its_body_is_in_is_counted_as_gone_not_as_a_bad_request():
    """``/metrics`` counts 499 for a client that left before its answer; one
    that left mid-body was counted 400, the answer nobody read."""
    engine = fake_engine()
    try:
        with serving(engine) as url:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(post_head("/v1/query", 100) + b'{"question": ')
                time.sleep(0.2)
            wait_for(lambda: query_counts(url))
            assert query_counts(url) == {"499": 1.0} and stats(url)["live_requests"] == 0
            # A client that stays for its answer still gets (and is counted) the 400 its body earns.
            bad = httpx.post(f"{url}/v1/query", content=b"{nope")
            assert bad.status_code == 400 and query_counts(url) == {"400": 1.0, "499": 1.0}
    finally:
        engine.close()


def test_health_answers_503_naming_the_engine_once_the_engine_has_stopped():
    """A probe was told "ok" while every request got a 503 naming the
    engine: a load balancer kept sending traffic to a server that could
    answer none of it."""
    broken = threading.Event()
    engine = cat_engine(broken=broken, delay_s=0.005)
    try:
        with serving(engine) as url, httpx.Client(base_url=url, timeout=10) as client:
            assert client.get("/health").json() == {"status": "ok", "model": "bubblefree"}
            running = threading.Thread(target=client.post, args=("/v1/query",),
                                       kwargs={"json": {"question": "a", "settings": {"max_tokens": 200}}})
            running.start()
            time.sleep(0.2)
            broken.set()
            running.join(10)
            health = client.get("/health")
            assert health.status_code == 503, health.text
            error = health.json()["error"]
            assert error["param"] == "engine" and "the device fell off the bus" in error["message"]
            assert client.post("/v1/query", json={"question": "a"}).status_code == 503  # as the probe says
            assert stats(url)["live_requests"] == 0
    finally:
        engine.close()


def test_health_answers_503_while_a_step_hangs_and_ok_once_it_ends():
    """A step that did not return (a hung kernel) kept the thread alive:
    ``/health`` said ok while every request timed out with 504."""
    hung, release = threading.Event(), threading.Event()
    cat, vocab = TOKENIZER.encode("cat")[0], len(TOKENIZER)

    def scores(prompt, position, prev):
        if hung.is_set():
            release.wait(20)
        return [1.0 if t == cat else 0.0 for t in range(vocab)]

    model = FakeModel(vocab_size=vocab, eos_id=TOKENIZER.eos_id, score_fn=scores)
    core = CoreEngine(FakeBackend(model=model, images=False, values=False))
    engine = Engine(core, SkillSet(TOKENIZER, core.register_mask, codec=None).compile_all())
    try:
        with serving(engine, stall_s=0.3) as url, httpx.Client(base_url=url, timeout=10) as client:
            hung.set()
            running = threading.Thread(target=client.post, args=("/v1/query",),
                                       kwargs={"json": {"question": "a", "settings": {"max_tokens": 5}}})
            running.start()
            wait_for(lambda: client.get("/health").status_code == 503)
            error = client.get("/health").json()["error"]
            assert error["param"] == "engine" and "no decode step has ended in" in error["message"]
            hung.clear()
            release.set()
            running.join(10)
            assert client.get("/health").status_code == 200
    finally:
        release.set()
        engine.close()


def test_health_answers_503_once_the_engine_is_closed():
    engine = fake_engine()
    with serving(engine) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        engine.close()
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == "engine: the engine is closed"


async def _a_bug_after_one_piece(*_: object):
    yield {"chunk": "x", "completed": False}
    raise RuntimeError("a bug")


@pytest.mark.parametrize("api,route,body", [
    ("moondream_api", "/v1/query", {"question": "a", "stream": True}),
    ("openai_api", "/v1/completions", {"prompt": "a", "stream": True}),
])
def test_a_bug_mid_stream_ends_the_stream_with_the_500_error_event(monkeypatch, api, route, body):
    """The stream was cut mid-body (the client read an incomplete chunked
    answer and no error): a bug answers 500 in the one JSON shape, here as
    the stream's last event, as the deadline's 504 and the shutdown's 503 do."""
    from bubblefree.server import moondream_api, openai_api

    monkeypatch.setattr({"moondream_api": moondream_api, "openai_api": openai_api}[api], "_chunks",
                        _a_bug_after_one_piece)
    engine = fake_engine()
    try:
        with serving(engine) as url:
            with httpx.stream("POST", url + route, json=body, timeout=10) as reply:
                lines = [line for line in reply.iter_lines() if line]
            events = [line.removeprefix("data: ") for line in lines]
            last = json.loads(events[-1] if api == "moondream_api" else events[-2])
            assert last["error"] == {"message": "server: an internal error (RuntimeError); the request "
                                                "did not complete", "type": "server_error", "param": "server",
                                     "code": 500}
            if api == "openai_api":
                assert events[-1] == "[DONE]"
            s = stats(url)
            assert s["live_requests"] == 0 and s["requests_by_status"] == {"200": 1}
    finally:
        engine.close()


@pytest.mark.parametrize("name,value", [
    ("max_live", float("nan")), ("max_body_bytes", float("nan")), ("max_header_bytes", float("nan")),
    ("max_image_pixels", float("nan")), ("max_json_values", 0), ("max_json_values", float("nan")),
    ("retry_after_s", 1.5), ("max_live", "8"), ("max_live", True),
    ("request_timeout_s", "30"), ("body_timeout_s", None), ("header_timeout_s", True),
])
def test_settings_refuse_values_no_bound_can_hold_naming_the_setting(name, value):
    """``nan < 1`` is false: a NaN ``max_live`` passed the check and
    admitted every request (``live >= nan`` never holds), a NaN
    ``max_body_bytes`` read any body; a string raised a TypeError naming
    nothing."""
    with pytest.raises(ValueError, match=f"^{name} must be "):
        ServerSettings(**{name: value})


def test_settings_keep_their_bounds_edges():
    edges = ServerSettings(max_live=1, request_timeout_s=float("inf"), body_timeout_s=1, header_timeout_s=0.5)
    assert (edges.max_live, edges.request_timeout_s, edges.body_timeout_s) == (1, float("inf"), 1)


def _no_load(args):
    raise AssertionError("the model loaded before the options were checked")


def test_a_pixel_limit_past_what_pillow_decodes_is_refused_naming_it(monkeypatch, capsys):
    """Past Pillow's own limit the server's was never honoured: an image
    between the two was refused in Pillow's words, as a bomb."""
    most = pillow_max_pixels()
    with pytest.raises(ValueError, match=f"^max_image_pixels must be at most {most}, "):
        ServerSettings(max_image_pixels=most + 1)
    assert ServerSettings(max_image_pixels=most).max_image_pixels == most
    monkeypatch.setattr(cli, "engine_maker", _no_load)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--random", "moondream-tiny", "--max-image-pixels", str(most + 1)])
    assert exit_.value.code == 2
    assert f"--max-image-pixels: must be in [1, {most}], got {most + 1}" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["a" * 64, "..", "x." + "b" * 70 + ".com"])
def test_a_host_name_no_resolver_takes_is_one_line_naming_the_host(monkeypatch, capsys, host):
    """A label over 63 characters, or an empty one, failed in the IDNA codec
    with a UnicodeError, not an OSError: a traceback, not one line."""
    monkeypatch.setattr(cli, "engine_maker", _no_load)
    assert cli.main(["serve", "--random", "moondream-tiny", "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bubblefree serve: error: --host {host!r}: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("address", ["127.0.0.1:\u00b2", "a" * 64 + ":6379"])
def test_a_ray_address_that_is_no_address_is_not_a_traceback(address):
    """``"\u00b2".isdigit()`` holds, but ``int`` refuses it; a host label
    past 63 characters fails in the IDNA codec. Both were tracebacks from
    ``serve --replicas``."""
    refused = cli.ray_address_refused(address, timeout_s=2.0)
    assert refused is None or refused.startswith(f"RAY_ADDRESS {address!r}: "), refused
