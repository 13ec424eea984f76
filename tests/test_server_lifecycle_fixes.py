"""A request's life at the server's edges: admitted before its image is
decoded (a Moondream route past ``--max-live`` is a 429 at once, not after
seconds of decoding), a bind error naming the flag to change, a URL longer
than the parser takes refused as the head's size (431), not as bad HTTP
(400), and ``serve`` running uvicorn without a lifespan task."""

from __future__ import annotations

import base64
import contextlib
import socket
from typing import Iterator

import httpx
import pytest
import uvicorn

from bubblefree.server import ServerSettings, cli, create_app, http_protocol, moondream_api
from tests.image_world import moon, picture, png  # noqa: F401 (moon: a fixture)
from tests.server_support import fake_engine, free_port, running

IMAGE = "data:image/png;base64," + base64.b64encode(png(picture(3, 64, 48))).decode()
BAD_IMAGE = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
ASK = {"question": "what", "settings": {"max_tokens": 3}}


@contextlib.contextmanager
def served(engine, **settings: object) -> Iterator[tuple[str, object]]:
    """The server's URL and its ``Served`` (so a test can hold a live slot)."""
    port = free_port()
    chosen = ServerSettings(port=port, **settings)
    app = create_app(engine, chosen)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=http_protocol(chosen),
                            log_level="warning", timeout_graceful_shutdown=2)
    with running(config) as url:
        yield url, app.state.served


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    """Each image the Moondream routes read, by field, the reader itself unchanged."""
    seen: list[str] = []
    real = moondream_api.read_image

    async def counted(served_, url, field):
        seen.append(field)
        return await real(served_, url, field)
    monkeypatch.setattr(moondream_api, "read_image", counted)
    return seen


@pytest.mark.parametrize("path,body", [
    ("/v1/query", {**ASK, "image_url": IMAGE}),
    ("/v1/query", {**ASK, "image_url": IMAGE, "stream": True}),
    ("/v1/caption", {"image_url": IMAGE, "settings": {"max_tokens": 3}}),
    ("/v1/point", {"object": "cat", "image_url": IMAGE}),
])
def test_past_max_live_a_moondream_route_is_refused_before_its_image_is_decoded(moon, decodes, path, body):
    """The image was decoded (0.74 s for 49 Mpx, in the worker pool every
    request shares) and only then was the request refused 429."""
    with served(moon, max_live=1) as (url, state), httpx.Client(timeout=20) as client:
        held = state.admission.enter()
        try:
            refused = client.post(f"{url}{path}", json=body)
        finally:
            held.leave()
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert decodes == []
        answered = client.post(f"{url}{path}", json=body)
        assert answered.status_code == 200, answered.text
        assert decodes == ["image_url"] and state.admission.live == 0


@pytest.mark.parametrize("stream", [False, True])
def test_an_admitted_request_whose_image_is_bad_is_a_422_and_frees_its_slot(moon, decodes, stream):
    with served(moon, max_live=1) as (url, state), httpx.Client(timeout=20) as client:
        for _ in range(2):  # the second finds the slot the first held given back
            bad = client.post(f"{url}/v1/query", json={**ASK, "image_url": BAD_IMAGE, "stream": stream})
            assert bad.status_code == 422, bad.text
            assert bad.json()["error"]["param"] == "image_url"
            assert state.admission.live == 0
        assert decodes == ["image_url", "image_url"]
        assert client.post(f"{url}/v1/query", json={**ASK, "image_url": IMAGE}).status_code == 200


def test_a_spatial_skill_on_a_text_model_is_refused_before_admission(decodes):
    """The refusal that needs no decoding stays ahead of the live bound."""
    engine = fake_engine()
    try:
        with served(engine, max_live=1) as (url, state), httpx.Client(timeout=20) as client:
            held = state.admission.enter()
            try:
                refused = client.post(f"{url}/v1/detect", json={"object": "cat", "image_url": IMAGE})
            finally:
                held.leave()
            assert refused.status_code == 422 and refused.json()["error"]["param"] == "image_url"
            assert decodes == []
    finally:
        engine.close()


def test_an_address_not_of_this_machine_names_the_host_and_a_taken_port_the_port():
    """It said "--port 2020 on 10.99.99.99: Cannot assign requested address"."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert cli.address_refused("127.0.0.1", port).startswith(f"--port {port} on 127.0.0.1: ")
    refused = cli.address_refused("192.0.2.1", port)  # TEST-NET: no machine's address
    assert refused.startswith("--host '192.0.2.1': ") and "--port" not in refused


def test_serve_runs_uvicorn_without_a_lifespan_task_and_waits_less_for_a_hung_engine(monkeypatch):
    """The app has no startup or shutdown handlers; with uvicorn's lifespan
    task a second Ctrl-C logged its CancelledError traceback. A decode
    thread hung in a device call held SIGTERM's exit for 71 s (the loop's
    60 s close wait, then 10 s at exit)."""
    app = create_app(fake_engine())
    assert not app.router.on_startup and not app.router.on_shutdown
    app.state.served.engine.close()
    options: dict = {}
    made = []

    def make():
        made.append(fake_engine())
        return made[-1]
    monkeypatch.setattr(cli, "engine_maker", lambda args: make)
    monkeypatch.setattr(uvicorn, "run", lambda app, **given: options.update(given))
    assert cli.main(["serve", "--port", "0"]) == 0
    assert options["lifespan"] == "off"
    assert made[0].loop.close_wait == cli.SERVE_CLOSE_WAIT_S and not made[0].loop.running


def head_answer(url: str, target_bytes: int) -> bytes:
    """The status line for a GET whose URL takes ``target_bytes``, the whole head sent in one write."""
    port = int(url.rsplit(":", 1)[1])
    head = b"GET /" + b"a" * (target_bytes - 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(head)
        reply = b""
        while b"\r\n" not in reply:
            more = raw.recv(4096)
            if not more:
                break
            reply += more
    return reply.split(b"\r\n", 1)[0]


def test_a_url_longer_than_the_parser_takes_is_the_heads_431_not_a_400():
    """httptools' URL parser refuses one over 65,535 bytes, and uvicorn
    answered that 400, "not valid HTTP/1.1", where the size bound's 431
    was due. Within a bound set higher, the URL's own 414."""
    engine = fake_engine()
    try:
        with served(engine) as (url, _):
            assert head_answer(url, 60_000).startswith(b"HTTP/1.1 404")
            assert head_answer(url, 65_600).startswith(b"HTTP/1.1 431")
        with served(engine, max_header_bytes=1 << 20) as (url, _):
            assert head_answer(url, 65_535).startswith(b"HTTP/1.1 404")
            assert head_answer(url, 70_000).startswith(b"HTTP/1.1 414")
    finally:
        engine.close()
