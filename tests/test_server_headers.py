"""A request's head (its line and headers) under hostile clients, on raw
sockets: a head over ``max_header_bytes`` gets 431 and a closed connection,
whole or still arriving; a connection whose head is not complete within
``header_timeout_s`` of its opening, or of its previous answer's end, is
cut then (408, or closed alone where nothing came), however its bytes
trickle; and neither bound touches a slow body or a long stream. After
each, the server answers others. These hold ``protocol.py``'s hooks into
uvicorn and httptools: if one stops being called, a test here fails."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bubblefree.server import ServerSettings, cli
from bubblefree.server.protocol import HeadBoundedProtocol
from server_support import fake_engine, free_port, running, serving

LIMIT = 4096  # max_header_bytes in these tests
SLACK_S = 1.0  # how late past a deadline a cut may come on a loaded 2-core machine
GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def engine():
    engine = fake_engine(("cat",), endless=True, delay_s=0.01)  # ~10 ms a token
    yield engine
    engine.close()


def connect(url: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5)


def read_answer(reader) -> tuple[int, dict[str, str], bytes]:
    """One response from a socket's ``makefile("rb")``, by its Content-Length."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers.get("content-length", 0)))


def until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it closes (a reset counts as closing)."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def trickle(sock: socket.socket, give_up_s: float) -> tuple[float, bytes]:
    """Send a head's byte every 0.1 s, never its end, until the server
    answers or closes; the seconds that took, and what it sent."""
    start = time.monotonic()
    while time.monotonic() - start < give_up_s:
        try:
            sock.sendall(b"a")
        except OSError:  # closed under us
            return time.monotonic() - start, until_closed(sock)
        if select.select([sock], [], [], 0.1)[0]:
            return time.monotonic() - start, until_closed(sock)
    raise AssertionError(f"a head trickling in was still open after {give_up_s} s")


def test_a_head_over_the_bound_gets_431_and_the_connection_closed_after_one_within_it(engine):
    with serving(engine, max_header_bytes=LIMIT) as url, connect(url) as sock:
        reader = sock.makefile("rb")
        near = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (LIMIT - 100) + b"\r\n\r\n"
        sock.sendall(near)  # within the bound: answered, and the connection kept
        assert read_answer(reader)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (2 * LIMIT) + b"\r\n\r\n")
        status, headers, body = read_answer(reader)
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"] == {
            "message": f"headers: larger than this server's limit of {LIMIT} bytes",
            "type": "request_too_large", "param": "headers", "code": 431}
        assert reader.read() == b""  # closed
        assert httpx.get(f"{url}/health").status_code == 200  # and others are served


def test_many_headers_over_the_bound_count_together(engine):
    lines = b"".join(b"X-%d: %s\r\n" % (i, b"b" * 60) for i in range(2 * LIMIT // 64))
    with serving(engine, max_header_bytes=LIMIT) as url, connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
        assert status_of(until_closed(sock)) == 431


def test_a_head_that_never_ends_is_cut_near_the_bound(engine):
    """Header lines sent as fast as the socket takes them, never the blank
    line that ends a head: the server stops reading near the bound, not
    at the end of memory. (A 431 may be lost to the reset a close with
    unread bytes sends; the cut is the point.)"""
    line = b"X-Pad: " + b"p" * 1000 + b"\r\n"
    with serving(engine, max_header_bytes=LIMIT) as url, connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        sent, start = 0, time.monotonic()
        with pytest.raises(OSError):  # a reset, or a broken pipe
            while sent < 64 * 1024 * 1024 and time.monotonic() - start < 10:
                sock.sendall(line)
                sent += len(line)
        got = until_closed(sock)
        assert got == b"" or status_of(got) == 431
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(engine):
    with serving(engine, header_timeout_s=0.5) as url:
        start = time.monotonic()  # before the connection: the deadline cannot start earlier
        with connect(url) as sock:
            assert until_closed(sock) == b""  # nothing to answer: closed alone
        assert 0.45 <= time.monotonic() - start <= 0.5 + SLACK_S


def test_a_head_trickling_in_is_cut_at_the_header_timeout_not_kept_by_each_byte(engine):
    with serving(engine, header_timeout_s=0.5) as url:
        start = time.monotonic()  # before the connection: the deadline cannot start earlier
        with connect(url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            _, got = trickle(sock, give_up_s=0.5 + SLACK_S + 2)
        assert 0.45 <= time.monotonic() - start <= 0.5 + SLACK_S
        head, _, body = got.partition(b"\r\n\r\n")
        assert status_of(head) == 408 and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["message"] == "headers: not received within 0.5 s"
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_kept_alive_connection_is_held_to_the_timeout_for_its_next_head(engine):
    """The deadline runs again from the end of each answer: a client that
    asked once cannot then trickle its next head for ever (uvicorn's own
    keep-alive timer stops at the next head's first byte)."""
    with serving(engine, header_timeout_s=0.5) as url, connect(url) as sock:
        reader = sock.makefile("rb")
        for _ in range(2):  # answered within the bound, twice, on one connection
            time.sleep(0.3)  # 0.6 s from the connection's opening: each answer re-arms the deadline
            sock.sendall(GET)
            assert read_answer(reader)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        took, got = trickle(sock, give_up_s=0.5 + SLACK_S + 2)
        assert took <= 0.5 + SLACK_S and status_of(got) == 408


def test_pipelined_requests_are_all_answered_then_the_idle_connection_closed(engine):
    with serving(engine, header_timeout_s=0.5) as url, connect(url) as sock:
        reader = sock.makefile("rb")
        sock.sendall(GET * 3)
        assert [read_answer(reader)[0] for _ in range(3)] == [200, 200, 200]
        start = time.monotonic()
        assert reader.read() == b""  # then closed, at the deadline after the last answer
        assert time.monotonic() - start <= 0.5 + SLACK_S


def test_a_slow_body_after_a_complete_head_is_the_body_timeouts_to_judge(engine):
    body = json.dumps({"question": "what", "settings": {"max_tokens": 2}}).encode()
    with serving(engine, header_timeout_s=0.5, body_timeout_s=3) as url, connect(url) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), len(body) // 5 + 1):  # over 1.5 s, three header timeouts
            time.sleep(0.3)
            sock.sendall(body[i:i + len(body) // 5 + 1])
        status, _, answer = read_answer(sock.makefile("rb"))
        assert status == 200 and json.loads(answer)["answer"] == "cat cat"


def test_a_body_that_stops_gets_the_body_timeouts_408_not_the_header_timeouts(engine):
    with serving(engine, header_timeout_s=0.3, body_timeout_s=1.2) as url, connect(url) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        start = time.monotonic()
        status, _, answer = read_answer(sock.makefile("rb"))
        assert status == 408 and json.loads(answer)["error"]["param"] == "body"
        assert time.monotonic() - start >= 1.1


def test_a_long_stream_is_not_cut_by_the_header_timeout(engine):
    query = {"question": "what", "stream": True, "settings": {"max_tokens": 150}}  # ~1.5 s of tokens
    with serving(engine, header_timeout_s=0.3) as url, httpx.Client(timeout=10) as client:
        start = time.monotonic()
        with client.stream("POST", f"{url}/v1/query", json=query) as reply:
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - start > 1.0  # five header timeouts and more
        assert events[-1]["completed"] is True and len(events) == 151


@pytest.mark.parametrize("head", [
    b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Length: \xc2\xb2\r\n\r\n{}",
    b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Length: 12345678901234567890123456\r\n\r\n{}",
    b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
    b"POST /v1/query HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1 extra\r\nHost: x\r\n\r\n",
], ids=["length not digits", "length past any size", "length and chunked", "bad chunk size", "bad line"])
def test_bytes_the_parser_refuses_get_400_in_the_json_shape(engine, head):
    """uvicorn answered them in plain text, "Invalid HTTP request
    received.": the one refusal outside the API's error shape."""
    with serving(engine) as url, connect(url) as sock:
        sock.sendall(head)
        raw = until_closed(sock)
        head_bytes, _, body = raw.partition(b"\r\n\r\n")
        assert status_of(raw) == 400 and b"content-type: application/json" in head_bytes.lower(), raw
        error = json.loads(body)["error"]
        assert error["param"] == "request" and error["code"] == 400, error
        assert error["message"].startswith("request: not valid HTTP/1.1"), error
        assert httpx.get(f"{url}/health").status_code == 200


def test_the_hooks_the_protocol_takes_are_still_uvicorns():
    """What ``HeadBoundedProtocol`` overrides must be called by uvicorn: a
    renamed hook would leave the bounds silently off (the tests above
    would fail too; this names the hook)."""
    for hook in ("connection_made", "connection_lost", "data_received", "on_message_begin",
                 "on_headers_complete", "on_response_complete", "send_400_response"):
        assert hook in vars(HttpToolsProtocol), f"uvicorn's HttpToolsProtocol has no {hook}"
        assert hook in vars(HeadBoundedProtocol)


@pytest.mark.parametrize("flag,value,why", [
    ("--max-header-bytes", "0", "must be >= 1, got 0"), ("--max-header-bytes", "-5", "must be >= 1"),
    ("--max-header-bytes", "64k", "must be an integer, got '64k'"),
    ("--header-timeout", "0", "must be > 0, got 0"), ("--header-timeout", "-1", "must be > 0"),
    ("--header-timeout", "nan", "must be > 0"), ("--header-timeout", "soon", "must be a number, got 'soon'"),
])
def test_a_bad_bound_is_a_usage_error_naming_its_flag(capsys, flag, value, why):
    with pytest.raises(SystemExit) as exit_:
        cli.parser().parse_args(["serve", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {why}" in err and "Traceback" not in err


@pytest.mark.parametrize("name,value", [("max_header_bytes", 0), ("header_timeout_s", 0.0),
                                        ("header_timeout_s", float("nan"))])
def test_settings_refuse_a_bad_bound_built_from_python(name, value):
    with pytest.raises(ValueError, match=name):
        ServerSettings(**{name: value})


def test_serve_runs_uvicorn_with_the_bounds_it_was_given(monkeypatch, capsys):
    """``bubblefree serve``'s own uvicorn call, served: the flags reach the
    protocol (an idle connection cut at the timeout, a large head 431)."""
    seen = {}

    def run(app, **options):  # uvicorn.run, served from a thread so the test can probe it
        seen.update(options)
        config = uvicorn.Config(app, **{**options, "port": free_port(), "log_level": "warning"})
        with running(config) as url:
            start = time.monotonic()  # before the connection: the deadline cannot start earlier
            with connect(url) as sock:
                seen["idle"] = (until_closed(sock), time.monotonic() - start)
            with connect(url) as big:
                big.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 2000 + b"\r\n\r\n")
                seen["big"] = status_of(until_closed(big))
            seen["health"] = httpx.get(f"{url}/health").status_code

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.setattr(cli, "engine_maker", lambda args: fake_engine)
    assert cli.main(["serve", "--port", "0", "--header-timeout", "0.4", "--max-header-bytes", "1024"]) == 0
    assert seen["idle"][0] == b"" and 0.38 <= seen["idle"][1] <= 0.4 + SLACK_S
    assert (seen["big"], seen["health"]) == (431, 200)


def test_replicas_refuse_a_header_timeout_they_could_not_keep(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = ["serve", "--random", "moondream-tiny", "--replicas", "1", "--header-timeout", "5", "--port", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("bubblefree serve: error: --header-timeout: not available with --replicas") \
        and err.count("\n") == 1, err


def test_many_heads_trickling_at_once_are_all_cut_and_others_answered_meanwhile(engine):
    """Twenty clients trickling heads at once, and one asking properly
    meanwhile: it is answered while they wait, and they are all cut."""
    with serving(engine, header_timeout_s=0.6) as url:
        socks = [connect(url) for _ in range(20)]
        results = []

        def hold(sock):
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            results.append(trickle(sock, give_up_s=0.6 + SLACK_S + 2))

        threads = [threading.Thread(target=hold, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
        for t in threads:
            t.join(10)
        for s in socks:
            s.close()
        assert len(results) == 20 and all(status_of(got) == 408 for _, got in results)
