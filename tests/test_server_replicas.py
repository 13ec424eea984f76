"""Two engine replicas on Ray Serve (CPU, the fake engine): both answer,
the load is spread over both, and a replica killed mid-request fails its
in-flight request at once (the stream is cut short, it does not hang) while
Ray Serve replaces it. Ray's own start is most of this file's time."""

from __future__ import annotations

import functools
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the ray extra: pip install bubblefree[ray]")
from ray import serve  # noqa: E402

import server_support  # noqa: E402
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
    with httpx.Client(trust_env=False, timeout=30) as http:
        answers = [ask(http, url) for _ in range(requests)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    return {r.headers[REPLICA_HEADER] for r in answers}


def test_both_replicas_answer(url):
    assert len(replicas_answering(url)) == 2


def test_a_replica_killed_mid_stream_cuts_the_stream_at_once_and_is_replaced(url):
    with httpx.Client(trust_env=False, timeout=30) as http:
        with http.stream("POST", f"{url}/v1/query", json={
                "question": "what", "stream": True, "settings": {"max_tokens": 200}}) as response:
            victim = response.headers[REPLICA_HEADER]
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            ray.kill(ray.get_actor(f"SERVE_REPLICA::bubblefree#{DEPLOYMENT}#{victim}", namespace="serve"),
                     no_restart=True)
            start = time.monotonic()
            # Ray's proxy cuts the stream off: the client sees the body end
            # short at once, instead of waiting on a replica that is gone.
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
                for line in lines:
                    assert '"completed":true' not in line
            assert time.monotonic() - start < 5
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        seen = replicas_answering(url, 12)
        if len(seen) == 2 and victim not in seen:
            break
        time.sleep(0.5)
    assert victim not in seen and len(seen) == 2
