"""A server on a free loopback port, in a thread, around a fake-backend Engine."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
from typing import Iterator

import httpx
import uvicorn

from bubblefree import Engine
from bubblefree.core import Engine as CoreEngine
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.server import ServerSettings, create_app, http_protocol
from bubblefree.skills import SkillSet, demo_tokenizer

TOKENIZER = demo_tokenizer(coord_bins=64, size_bins=16)


ANSWER = ("the", "cat", "sits", "on", "the", "mat", ".")


def fake_engine(script: tuple[str, ...] | None = ANSWER, *, endless: bool = False, delay_s: float = 0.0,
                num_pages: int = 64, max_rows: int = 4) -> Engine:
    """A text engine: the demo tokenizer's words, no spatial codec (like the
    embedded model loaded without location tokens). Every answer is
    ``script`` then EOS (or ``script`` over and over, if ``endless``); each
    sampled token takes ``delay_s`` of the decode thread, so a test can catch
    a request while it runs."""
    ids = [TOKENIZER.encode(w)[0] for w in script or ()]
    vocab, eos = len(TOKENIZER), TOKENIZER.eos_id

    def scores(prompt: tuple[int, ...], position: int, prev: int) -> list[float]:
        if delay_s:
            time.sleep(delay_s)
        i = position - len(prompt)
        token = ids[i % len(ids)] if endless or i < len(ids) else eos
        return [1.0 if t == token else 0.0 for t in range(vocab)]

    model = FakeModel(vocab_size=vocab, eos_id=eos, score_fn=scores if script else None)
    core = CoreEngine(FakeBackend(model=model, num_pages=num_pages, max_rows=max_rows,
                                  images=False, values=False))
    return Engine(core, SkillSet(TOKENIZER, core.register_mask, codec=None).compile_all())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(engine: Engine, **settings: object) -> Iterator[str]:
    """Serve ``engine`` until the block ends, as ``bubblefree serve`` does
    (its HTTP protocol included); yields the base URL."""
    port = free_port()
    chosen = ServerSettings(port=port, **settings)
    with running(uvicorn.Config(create_app(engine, chosen), host="127.0.0.1", port=port,
                                http=http_protocol(chosen), log_level="warning",
                                timeout_graceful_shutdown=2)) as url:
        yield url


@contextlib.contextmanager
def running(config: uvicorn.Config) -> Iterator[str]:
    """Run a uvicorn server with ``config`` in a thread until the block
    ends; yields its base URL."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def healthy(url: str, server: subprocess.Popen, within_s: float) -> str:
    """The model ``/health`` names once the server answers it with 200 (Ray
    Serve's proxy answers 404 in plain text until its app is up); fails if
    ``server`` exits first or time runs out."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {server.communicate()[0]}")
        try:
            response = httpx.get(f"{url}/health", timeout=2, trust_env=False)
            if response.status_code == 200:
                return response.json()["model"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no /health within {within_s} s")


def interrupt(server: subprocess.Popen, times: int = 1, within_s: float = 30) -> str:
    """SIGINT ``server`` ``times`` times (0.3 s apart), then its output once
    it exits; killed if it has not within ``within_s``."""
    for i in range(times):
        if i:
            time.sleep(0.3)
        server.send_signal(signal.SIGINT)
    try:
        return server.communicate(timeout=within_s)[0]
    except subprocess.TimeoutExpired:
        server.kill()
        return server.communicate()[0]
