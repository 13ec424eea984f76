"""Moondream's routes under hostile clients: many at once, some leaving while
they wait, some reading a stream in part and dropping it; one leaving while
its large image decodes; a stream the deadline cuts, read by moondream's
own client. Each ends cleanly (an answer, a 4xx naming its field, or a
stream that ends ``completed``), never a 500 or a hang; every KV page comes
back and the server serves on."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import random
import socket
import time

import httpx
import moondream
import pytest
from PIL import Image

from bubblefree import Engine
from bubblefree.core import Engine as CoreEngine
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.skills import RegionHeadCodec, SkillSet
from tests.image_world import EOS, MOON_TOK, WORDS, picture, png, scores_model
from tests.server_support import serving
from tests.test_server_moondream_adversarial import (  # noqa: F401 (loc, loc_url: fixtures)
    BODIES, IMAGE, data_uri, loc, loc_url, named_or_answered, serves_on)


def stats(client: httpx.Client) -> dict:
    return client.get("/v1/stats").json()


def settled(client: httpx.Client, within_s: float = 10) -> dict:
    """``/v1/stats`` once nothing is live or queued and every page is back."""
    deadline = time.monotonic() + within_s
    while True:
        s = stats(client)
        if s["live_requests"] == 0 and s["queue_depth"] == 0 and s["kv_pages"]["free"] == s["kv_pages"]["total"]:
            return s
        assert time.monotonic() < deadline, f"not settled: {s}"
        time.sleep(0.02)


# -- many clients, some leaving ---------------------------------------------------

def slow_moon(delay_s: float) -> Engine:
    """moondream2's way (``image_world.moon_engine``), each sampled token
    taking ``delay_s`` of the decode thread, answers long (EOS rarely wins):
    a client leaving mid-answer finds its request still running."""
    base = scores_model(eos_every=40)

    def scores(prompt, position, prev):
        time.sleep(delay_s)
        return base.scores(prompt, position, prev)

    core = CoreEngine(FakeBackend(model=FakeModel(vocab_size=len(WORDS), eos_id=EOS, score_fn=scores),
                                  num_pages=512, max_rows=8, max_seqs=16, max_context=512,
                                  max_prefill_tokens=128, image_length=5))
    return Engine(core, SkillSet(MOON_TOK, core.register_mask,
                                 codec=RegionHeadCodec.for_tokenizer(MOON_TOK)).compile_all())


async def _one_client(client: httpx.AsyncClient, rng: random.Random, images: list[str]) -> str:
    """One request of a random route, streamed or not, read whole, left
    while waiting, or (a stream) read in part and dropped; what became of it."""
    route = rng.choice(["query", "caption", "point", "detect"])
    body = {**BODIES[route], "image_url": rng.choice(images), "settings": {"max_tokens": rng.randint(1, 120)}}
    stream = route in ("query", "caption") and rng.random() < 0.6
    leave = rng.choice(["never", "while waiting", "after a piece"])

    async def ask() -> str:
        if not stream:
            reply = await client.post(f"/v1/{route}", json=body)
            named_or_answered(reply, route)
            return "answered"
        async with client.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as reply:
            assert reply.status_code == 200, route
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if leave == "after a piece":
                    return "left mid-stream"
                if event["completed"]:
                    assert "error" not in event, event
                    return "streamed"
        raise AssertionError(f"{route}: the stream ended without completed: true")

    if leave != "while waiting":
        return await ask()
    try:
        return await asyncio.wait_for(ask(), rng.uniform(0.0, 0.3))
    except asyncio.TimeoutError:
        return "left while waiting"


def test_many_clients_some_leaving_mid_answer_leave_every_page_back():
    engine = slow_moon(0.002)
    images = [data_uri(png(picture(seed, 40 + seed, 30))) for seed in range(6)]
    rng = random.Random(7)

    async def crowd(url: str) -> list[str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(_one_client(client, rng, images) for _ in range(150)))

    try:
        with serving(engine, max_live=256) as url, httpx.Client(base_url=url, timeout=30) as client:
            outcomes = asyncio.run(crowd(url))
            assert {"answered", "streamed", "left mid-stream", "left while waiting"} <= set(outcomes)
            counted = settled(client)["requests_by_status"]
            assert "500" not in counted, counted
            serves_on(client)
    finally:
        engine.close()


@functools.cache
def large_image() -> str:
    """36 million pixels of one colour: a small body, a decode of a second or so."""
    return data_uri(png(Image.new("RGB", (6000, 6000), (9, 80, 200))))


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_its_large_image_decodes_frees_everything(stream):
    """The image is decoded before the request is admitted, in a worker
    thread; the client gone by then is found when its answer is raced
    against ``http.disconnect``: a 499 for a whole answer, and a stream's
    request cancelled; its pages back long before its tokens could run."""
    engine = slow_moon(0.05)  # 300 tokens: 15 s
    body = json.dumps({"question": "what", "image_url": large_image(), "stream": stream,
                       "settings": {"max_tokens": 300}}).encode()
    try:
        with serving(engine) as url, httpx.Client(base_url=url, timeout=30) as client:
            port = int(url.rsplit(":", 1)[1])
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(0.05)
            deadline = time.monotonic() + 10
            while "/v1/query" not in client.get("/metrics").text:
                assert time.monotonic() < deadline, "the request was never answered or counted"
                time.sleep(0.05)
            settled(client, within_s=10)
            assert time.monotonic() - started < 10
            if not stream:
                assert 'route="/v1/query",status="499"' in client.get("/metrics").text
            serves_on(client)
    finally:
        engine.close()


# -- what moondream's client reads -----------------------------------------------

def test_moondreams_client_reads_every_route_segment_included(loc_url, loc):
    md = moondream.vl(endpoint=f"{loc_url}/v1")
    jpeg = base64.b64decode(md.encode_image(IMAGE).image_url.partition(",")[2])
    whole = loc.segment(jpeg, "cat")  # the client keeps bbox only where there is one
    assert md.segment(IMAGE, "cat") == {"path": whole["path"], **({"bbox": whole["bbox"]} if whole["bbox"] else {})}
    assert md.point(IMAGE, "cat") == {"points": loc.point(jpeg, "cat")["points"]}
    assert md.detect(IMAGE, "cat") == {"objects": loc.detect(jpeg, "cat")["objects"]}
    assert md.caption(IMAGE) == {"caption": loc.caption(jpeg)["caption"]}
    pieces = "".join(md.query(IMAGE, "what is it", stream=True)["answer"])
    assert pieces.strip() == loc.query(jpeg, "what is it")["answer"]


def test_a_stream_cut_by_the_deadline_ends_moondreams_reader():
    """The error event carries ``completed: true``: the client's reader
    stops there (its loop breaks on it) instead of waiting on a socket."""
    engine = slow_moon(0.02)
    try:
        with serving(engine, request_timeout_s=0.5) as url:
            md = moondream.vl(endpoint=f"{url}/v1")
            started = time.monotonic()
            pieces = list(md.query(IMAGE, "what is it", stream=True, settings={"max_tokens": 300})["answer"])
            assert time.monotonic() - started < 5 and len(pieces) < 300
            with httpx.Client(base_url=url, timeout=30) as client:
                settled(client)
                short = {"question": "what", "settings": {"max_tokens": 2}}
                assert client.post("/v1/query", json=short).status_code == 200
    finally:
        engine.close()
