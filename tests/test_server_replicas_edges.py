"""The Ray relay against hostile and unlucky callers, held to what one
server answers: every bad input of test_server_bad_input.py (and a route's
bug, a missing key, a body past the limit, headers past theirs) gets the same status and the
same JSON error through the relay; a body that stops arriving is a 408, a
``Content-Length`` past the limit a 413 at once; past ``max_live`` a 429,
with health and stats still answered; a client that leaves frees its
request; a shutdown refuses new requests in the API's shape until the
port closes, and lets those in flight finish or answers them in it; a
replica that cannot build its engine is one line and exit 2, as without
Ray. Two replicas of the fake engine on one Ray cluster for the
module, after the one test that runs the command."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra: pip install bubblefree[ray]")
from ray import serve  # noqa: E402

import replica_support  # noqa: E402
import server_support  # noqa: E402
from bubblefree.server import ServerSettings, cli  # noqa: E402
from bubblefree.server.replicas import REPLICA_HEADER, application, stop  # noqa: E402
from replica_support import BUG, faulty_engine  # noqa: E402
from server_support import free_port, serving  # noqa: E402
from test_server_bad_input import CASES  # noqa: E402

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
SETTINGS = ServerSettings(api_key=KEY, max_body_bytes=300_000, body_timeout_s=1.0, max_live=3)
# A partial, not a function of this module: the replicas cannot import it.
ENGINE = functools.partial(faulty_engine, endless=True, delay_s=0.02)


def test_a_replica_that_cannot_build_its_engine_is_one_line_and_exit_2_as_without_replicas(capsys):
    """Runs first, before the module's cluster: the command starts its own.
    Ray's deploy failure was a driver traceback and exit 1."""
    assert cli.main(["serve", "--random", "moondream-tiny", "--device", "bogus", "--port", "0"]) == 2
    alone = capsys.readouterr().err.strip()
    assert alone.startswith("bubblefree serve: error: device: 'bogus' is not a device")
    env = {**os.environ, "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"}  # one failed start is enough
    done = subprocess.run([sys.executable, "-m", "bubblefree", "serve", "--random", "moondream-tiny",
                           "--device", "bogus", "--port", str(free_port()), "--log-level", "warning",
                           "--replicas", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert alone in done.stderr.splitlines(), done.stderr
    assert "Traceback (most recent call last):\n  File" not in done.stderr, done.stderr


@pytest.fixture(scope="module")
def url():
    from ray import cloudpickle
    for module in (server_support, replica_support):  # the replicas cannot import the tests' helpers
        cloudpickle.register_pickle_by_value(module)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=80 * 1024 * 1024)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(ENGINE, SETTINGS, replicas=2, gpus=False, health_check_period_s=1.0, grace_s=1.0),
                  name="bubblefree", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def alone():
    """One server (no Ray) around the same engine and settings."""
    engine = ENGINE()
    with serving(engine, **{k: getattr(SETTINGS, k) for k in
                            ("api_key", "max_body_bytes", "body_timeout_s", "max_live")}) as url:
        yield url
    engine.close()


def _answer(url: str, method: str, route: str, body, headers: dict) -> tuple[int, object, dict]:
    kwargs = {"content": body} if isinstance(body, bytes) else {} if body is None else {"json": body}
    with httpx.Client(trust_env=False, timeout=20) as http:
        reply = http.request(method, url + route, headers=headers, **kwargs)
    kept = {k: reply.headers.get(k) for k in ("content-type", "retry-after", "www-authenticate")}
    return reply.status_code, reply.json(), kept


# (case, method, route, body, headers): beside the bad-input table's rows.
MORE = [
    ("a field name no UTF-8 can hold", "POST", "/v1/query", b'{"question": "a", "\\ud800": 1}', AUTH),
    ("a nested one", "POST", "/v1/query", b'{"question": "a", "settings": {"\\udc80": 1}}', AUTH),
    ("a route that raises", "POST", "/v1/query", {"question": BUG}, AUTH),
    ("no api key", "POST", "/v1/query", {"question": "a"}, {}),
    ("a wrong api key", "POST", "/v1/query", {"question": "a"}, {"Authorization": "Bearer j"}),
    ("a body past the limit", "POST", "/v1/query", b"x" * (SETTINGS.max_body_bytes + 1), AUTH),
    ("a body past the limit, no key", "POST", "/v1/query", b"x" * (SETTINGS.max_body_bytes + 1), {}),
    ("unknown route, no key", "GET", "/v1/nothing", None, {}),
    ("headers past the limit", "GET", "/health", None, {"X-Pad": "a" * SETTINGS.max_header_bytes}),
]
EVERY = [(c[0], c[1], c[2], c[3], AUTH) for c in CASES] + MORE


@pytest.mark.parametrize("case,method,route,body,headers", EVERY, ids=[c[0] for c in EVERY])
def test_the_relay_answers_bad_input_as_one_server_does(url, alone, case, method, route, body, headers):
    """Status, JSON error and headers alike; a route's bug was a 503 naming
    the replica (Starlette's error middleware raises again after its 500),
    a missing key with a body past the limit a 413."""
    relayed = _answer(url, method, route, body, headers)
    assert relayed == _answer(alone, method, route, body, headers)
    assert relayed[0] >= 400 and relayed[1]["error"]["code"] == relayed[0]


def _partial(url: str, length: int, sent: bytes = b"", key: bool = True) -> tuple[int, dict, float]:
    """A POST that promises ``length`` bytes of body and sends ``sent``:
    its answer's status and JSON error, and how long the answer took."""
    host, port = url.rsplit("/", 1)[1].split(":")
    conn = HTTPConnection(host, int(port), timeout=10)
    try:
        conn.putrequest("POST", "/v1/query")
        for name, value in {"Content-Type": "application/json", "Content-Length": str(length),
                            **(AUTH if key else {})}.items():
            conn.putheader(name, value)
        conn.endheaders(sent or None)
        started = time.monotonic()
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())["error"], time.monotonic() - started
    finally:
        conn.close()


def test_a_body_that_stops_arriving_is_a_408_through_the_relay(url):
    """It held the relay's call for ever: the relay read the body with no
    deadline, and the replica's own only starts once the body is in."""
    status, error, waited = _partial(url, 100, b'{"question": ')
    assert status == 408 and error == {"message": "body: not received within 1 s", "type": "timeout_error",
                                       "param": "body", "code": 408}
    assert waited < 5


@pytest.mark.parametrize("key", [True, False])
def test_a_content_length_past_the_limit_is_refused_at_once_through_the_relay(url, key):
    """One server refuses it from the header (401 first without the key);
    the relay waited for a body that never came."""
    status, error, waited = _partial(url, 10**9, key=key)
    assert (status, error["param"]) == ((413, "body") if key else (401, "authorization"))
    assert waited < 2


def _stats_of_each(http: httpx.Client, within_s: float = 15) -> dict[str, dict]:
    """``/v1/stats`` of both replicas, asked four at a time so that Ray's
    router spreads the asks."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + within_s
    with ThreadPoolExecutor(4) as pool:
        while len(seen) < 2 and time.monotonic() < deadline:
            for r in pool.map(lambda _: http.get("/v1/stats", headers=AUTH), range(4)):
                if r.status_code == 200:
                    seen[r.headers[REPLICA_HEADER]] = r.json()
    assert len(seen) == 2, seen
    return seen


def _all_freed(http: httpx.Client, within_s: float = 5) -> dict[str, dict]:
    deadline = time.monotonic() + within_s
    while True:
        seen = _stats_of_each(http)
        if all(s["live_requests"] == 0 and s["kv_pages"]["free"] == s["kv_pages"]["total"]
               for s in seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.1)


def _assert_freed(http: httpx.Client) -> None:
    for stats in _all_freed(http).values():
        assert stats["live_requests"] == 0 and stats["kv_pages"]["free"] == stats["kv_pages"]["total"], stats


def test_past_max_live_a_429_at_once_and_health_and_stats_still_answer(url):
    """Eight streams against two replicas of ``max_live`` 3: at most six
    are served, the rest are refused 429 with Retry-After at once, and
    /health and /v1/stats answer while the six run. Ray's cap on a replica
    was ``max_live`` itself: the two waited unanswered in the relay's
    queue, and so did every health check and stats read."""
    replies: list = []
    lock, release = threading.Lock(), threading.Event()

    def stream():
        try:
            with httpx.Client(trust_env=False, timeout=3) as http, http.stream(
                    "POST", f"{url}/v1/query", headers=AUTH,
                    json={"question": "what", "stream": True, "settings": {"max_tokens": 250}}) as reply:
                with lock:
                    replies.append((reply.status_code, reply.headers.get("retry-after"),
                                    reply.read() if reply.status_code != 200 else None))
                if reply.status_code == 200:
                    release.wait(20)
        except httpx.HTTPError as err:
            with lock:
                replies.append((None, None, repr(err)))

    clients = [threading.Thread(target=stream) for _ in range(8)]
    for c in clients:
        c.start()
    try:
        deadline = time.monotonic() + 5
        while len(replies) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=url, trust_env=False, timeout=3) as http:
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            assert http.get("/v1/stats", headers=AUTH).status_code == 200
            asked = time.monotonic() - started
    finally:
        release.set()
        for c in clients:
            c.join(30)
    statuses = sorted(r[0] for r in replies if r[0] is not None)
    assert len(statuses) == 8, replies
    assert statuses.count(200) <= 6 and statuses.count(429) >= 2 and set(statuses) <= {200, 429}, replies
    for status, retry_after, body in replies:
        if status == 429:
            assert retry_after == "1" and json.loads(body)["error"]["param"] == "request"
    assert asked < 1.0
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
        _assert_freed(http)


def test_a_client_that_leaves_before_its_whole_answer_frees_it_on_the_replica(url):
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/query", headers=AUTH, timeout=httpx.Timeout(10, read=0.5),
                      json={"question": "what", "settings": {"max_tokens": 250}})
        _assert_freed(http)


class Broken:
    """A replica's answer as Ray streams it: ``messages`` and then ``err``."""

    def __init__(self, messages, err):
        self.messages, self.err, self.cancelled = list(messages), err, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.messages:
            return self.messages.pop(0)
        raise self.err

    def cancel(self):
        self.cancelled = True


def bug_in_replica():
    from ray.exceptions import RayTaskError
    return RayTaskError("http", "Traceback ...", RuntimeError("a bug")).as_instanceof_cause()


@pytest.mark.parametrize("err, status, param, says", [
    (bug_in_replica(), 500, "server", "server: an internal error (RuntimeError)"),
    (ray.exceptions.ActorDiedError(), 503, "replica", "replica: the replica serving this request stopped"),
    (serve.exceptions.RequestCancelledError(), 503, "server", "server: shutting down; this request was"),
])
def test_an_answer_that_breaks_off_names_a_bug_as_a_bug_and_a_dead_replica_as_gone(err, status,
                                                                                   param, says):
    """Mid-stream, a route's own exception was worded as the replica dying
    (a 503 to retry); one server words a bug as its 500. A call the relay
    cancelled while reading it was cut by its drain: the server's shutdown."""
    import asyncio

    from bubblefree.server.relay import _bodies, _whole
    start = {"type": "http.response.start", "status": 200, "headers": []}
    piece = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}

    async def stream():
        messages = Broken([piece], err)
        return [chunk async for chunk in _bodies(messages)], messages.cancelled
    chunks, cancelled = asyncio.run(stream())
    assert chunks[0] == piece["body"] and cancelled
    assert chunks[1].startswith(b"event: error\ndata: ")
    event = json.loads(chunks[1].split(b"data: ", 1)[1])["error"]
    assert (event["code"], event["param"]) == (status, param) and event["message"].startswith(says)
    whole = asyncio.run(_whole(Broken([piece], err), start))
    body = json.loads(whole.body)["error"]
    assert whole.status_code == status and (body["code"], body["param"]) == (status, param)
    assert body["message"].startswith(says)
    assert (whole.headers.get("retry-after") == "1") == (status == 503)


def _asked(url: str, tokens: int, stream: bool) -> tuple[int, str | None, list[str], float] | Exception:
    """A query's status, Retry-After, non-empty lines and when it ended."""
    try:
        with httpx.Client(trust_env=False, timeout=30) as http, http.stream(
                "POST", f"{url}/v1/query", headers=AUTH,
                json={"question": "what", "stream": stream, "settings": {"max_tokens": tokens}}) as reply:
            lines = [line for line in reply.iter_lines() if line]
            return reply.status_code, reply.headers.get("retry-after"), lines, time.monotonic()
    except httpx.HTTPError as err:
        return err


def _until_closed(url: str, begun: threading.Event, within_s: float = 30) -> list[tuple]:
    """From ``begun`` until the port closes, ``/health`` asked again and
    again: each answer's status, content type, Retry-After and body."""
    answers: list[tuple] = []
    begun.wait()
    deadline = time.monotonic() + within_s
    with httpx.Client(trust_env=False, timeout=10) as http:
        while time.monotonic() < deadline:
            try:
                reply = http.get(f"{url}/health")
            except httpx.ConnectError:  # the port is closed
                return answers
            except httpx.TransportError:  # the proxy stopped while it was asked
                time.sleep(0.02)
                continue
            answers.append((reply.status_code, reply.headers.get("content-type"),
                            reply.headers.get("retry-after"), reply.text))
            time.sleep(0.02)
    raise AssertionError(f"the port was still open after {within_s} s")


def test_a_shutdown_refuses_new_requests_and_answers_those_in_flight_in_the_apis_shape(url):
    """``serve --replicas`` stops as ``stop()`` does. From the moment it
    begins until the port closes, every answer is the server's: once the
    relays drain, each new request gets a JSON 503 naming the shutdown,
    with Retry-After (``serve.delete`` first took the route off Ray's proxy
    at once: for seconds every new request got its plain-text 404); a
    request in flight that ends within the grace (2 s here) gets its whole
    answer; one still running then gets the 503, or a stream's last error
    event, that one server gives a request its shutdown cut
    (``serve.shutdown`` alone killed the proxy first: every open
    connection was cut without an answer). Last in this module: it ends
    the application."""
    asked: dict = {}

    def ask(tokens: int, stream: bool):
        asked[tokens, stream] = _asked(url, tokens, stream)

    def sent(tokens: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=ask, args=(tokens, stream)) for stream in (False, True)]
        for t in threads:
            t.start()
        return threads

    begun, health = threading.Event(), []
    hammer = threading.Thread(target=lambda: health.extend(_until_closed(url, begun)))
    hammer.start()
    # The short two first: a replica's pages hold one 250-token request at
    # a time, and a short one queued behind it would still wait at the grace.
    asking = sent(30)
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
        deadline = time.monotonic() + 5
        while (sum(stats["live_requests"] for stats in _stats_of_each(http).values()) < 2
               and time.monotonic() < deadline):
            time.sleep(0.02)
    asking += sent(250)
    time.sleep(0.1)  # all four are in; 30 tokens take 0.6 s at least, 1.2 s at most
    started = time.monotonic()
    begun.set()
    stop(grace_s=2.0)
    for t in [*asking, hammer]:
        t.join(30)
    assert time.monotonic() - started < 15
    # /health answers as ever until the drain reaches the relays, then the 503.
    refused = [answer for answer in health if answer[0] != 200]
    assert refused, f"none of {len(health)} asks was refused"
    for status, kind, retry_after, body in refused:
        assert (status, kind, retry_after) == (503, "application/json", "1"), (status, kind, body[:100])
        assert json.loads(body)["error"] == {"message": "server: shutting down; not taking new requests",
                                             "type": "server_error", "param": "server", "code": 503}
    assert not any(isinstance(answer, Exception) for answer in asked.values()), asked
    status, _, lines, ended = asked[30, False]
    assert status == 200 and ended > started and json.loads(lines[0])["answer"], asked
    status, _, lines, ended = asked[30, True]
    assert status == 200 and ended > started and json.loads(lines[-1].removeprefix("data: "))["completed"], asked
    status, retry_after, lines, _ = asked[250, False]
    assert (status, retry_after) == (503, "1"), asked
    assert json.loads(lines[0])["error"] == {"message": "server: shutting down; this request was cancelled "
                                             "before its answer", "type": "server_error", "param": "server",
                                             "code": 503}
    status, _, lines, _ = asked[250, True]
    assert status == 200 and lines[-2] == "event: error", asked
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["param"] == "server"
