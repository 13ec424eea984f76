"""Moondream's routes under a hostile client's input: every field of every
route given every wrong kind of value, streamed or not; data URIs
malformed, truncated or not images at all; images that fill the context; a
text model asked for a spatial skill with an image. Each gets a 4xx naming
its field, or its answer (a stream that ends ``completed``): never a 500,
and the server serves on. The clients that leave, crowd or read in part:
``test_server_moondream_adversarial_clients.py``."""

from __future__ import annotations

import base64
import copy
import json
import struct
import zlib

import httpx
import pytest

from tests.image_world import loc, moon, moon_engine, picture, png  # noqa: F401 (loc, moon: fixtures)
from tests.server_support import fake_engine, serving

IMAGE = picture(5, 64, 48)
URI = "data:image/png;base64," + base64.b64encode(png(IMAGE)).decode()
# Each route's smallest good body: the matrix below spoils one field at a time.
BODIES = {
    "query": {"question": "what is it", "image_url": URI},
    "caption": {"image_url": URI},
    "point": {"object": "cat", "image_url": URI},
    "detect": {"object": "cat", "image_url": URI},
    "segment": {"object": "cat", "image_url": URI},
}
FIELDS = ("question", "object", "image_url", "length", "stream", "model", "settings", "spatial_refs",
          "reasoning", "settings.temperature", "settings.top_p", "settings.top_k", "settings.min_p",
          "settings.max_tokens", "settings.max_objects", "settings.seed")
# Every JSON kind a field could be given where it wants another.
WRONG = {"null": None, "integer": 5, "negative": -1, "zero": 0, "number": 1.5, "huge integer": 10 ** 400,
         "boolean": True, "string": "x", "empty string": "", "long string": "x " * 50_000,
         "lone surrogate": "\ud800", "object": {"a": 1}, "array": [1, 2], "nested": {"x": [[{"y": None}]]}}


def body_bytes(body: dict) -> bytes:
    """``body`` as JSON, lone surrogates kept as their escapes (valid JSON)."""
    return json.dumps(body).encode()


def spoiled(route: str, field: str, value: object, stream: bool) -> dict:
    body = copy.deepcopy(BODIES[route])
    if stream:
        body["stream"] = True
    if field.startswith("settings."):
        settings = body.get("settings")
        body["settings"] = {**(settings if isinstance(settings, dict) else {}), field.removeprefix("settings."): value}
    else:
        body[field] = value
    return body


def refused(reply: httpx.Response, field: str, status: int = 422) -> str:
    """The refusal's message, once it is checked to name ``field``."""
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}: "), error
    return error["message"]


def named_or_answered(reply: httpx.Response, what: str) -> None:
    """A 2xx answer (a whole one, or a stream that ends ``completed``), or a
    4xx whose ``param`` names the field its message opens with."""
    assert reply.status_code in (200, 400, 422), f"{what}: {reply.status_code} {reply.text[:300]}"
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["param"] and error["message"].startswith(f"{error['param']}: "), (what, error)
    elif reply.headers["content-type"].startswith("text/event-stream"):
        last = json.loads(reply.text.strip().split("\n\n")[-1].removeprefix("data: "))
        assert last["completed"] is True and "error" not in last, (what, last)


def serves_on(client: httpx.Client) -> None:
    reply = client.post("/v1/point", json={"object": "cat", "image_url": URI})
    assert reply.status_code == 200 and isinstance(reply.json()["points"], list), reply.text[:300]


def data_uri(data: bytes, head: str = "data:image/png;base64,") -> str:
    return head + base64.b64encode(data).decode()


def png_head(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds a few bytes of
    pixels: the size is all a pixel limit reads. (Pillow 13 no longer opens
    a PNG of a header alone: it reads on to the first IDAT.)"""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + \
        chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def loc_url(loc):
    with serving(loc) as base:
        yield base


@pytest.fixture(scope="module")
def moon_url(moon):
    with serving(moon) as base:
        yield base


# -- every field, every wrong kind -----------------------------------------------

@pytest.mark.parametrize("route", sorted(BODIES))
@pytest.mark.parametrize("model", ["moondream2", "location tokens"])
def test_every_field_given_every_kind_is_named_or_answered(route, model, moon_url, loc_url):
    url = moon_url if model == "moondream2" else loc_url
    with httpx.Client(base_url=url, timeout=30) as client:
        for field in FIELDS:
            for kind, value in WRONG.items():
                for stream in (False, True):
                    body = spoiled(route, field, value, stream)
                    reply = client.post(f"/v1/{route}", content=body_bytes(body),
                                        headers={"content-type": "application/json"})
                    named_or_answered(reply, f"{route} {field}={kind} stream={stream}")
        serves_on(client)


# -- data URIs -------------------------------------------------------------------

GOOD = base64.b64encode(png(IMAGE)).decode()
# (case, image_url, the words the refusal holds)
BAD_URIS = [
    ("a web URL", "https://example.com/cat.png", "this server fetches no URLs"),
    ("a file URL", "file:///etc/passwd", "this server fetches no URLs"),
    ("bare base64", GOOD, "must be a data URI"),
    ("no base64 marker", "data:image/png," + GOOD, "must be a data URI"),
    ("no comma", "data:image/png;base64", "must be a data URI"),
    ("empty", "", "must be a data URI"),
    ("nothing after the comma", "data:image/png;base64,", "empty bytes"),
    ("truncated base64", "data:image/png;base64," + GOOD[:-3], "not valid base64"),
    ("URL-safe alphabet", data_uri(b"\xfb\xff" * 40).replace("+", "-").replace("/", "_"), "not valid base64"),
    ("not ASCII", "data:image/png;base64,\u00e9" + GOOD, "not valid base64"),
    ("a lone surrogate", "data:image/png;base64,\ud800", "not valid base64"),
    ("a second comma", "data:image/png;base64," + GOOD + ",AAAA", "not valid base64"),
    ("text, not an image", data_uri(b"hello, world", "data:text/plain;base64,"), "not an image Pillow can read"),
    ("an SVG", data_uri(b"<svg xmlns='http://www.w3.org/2000/svg'/>"), "not an image Pillow can read"),
    ("half a PNG", data_uri(png(IMAGE)[:200]), "truncated"),
    ("a zero-size PNG", data_uri(png_head(0, 0)), "not an image"),  # Pillow refuses it at open
    ("a PNG of 1 x 0", data_uri(png_head(1, 0)), "not an image"),
    ("a PNG header of 10000 x 10000", data_uri(png_head(10_000, 10_000)), "over the limit of 50000000"),
    ("a PNG header past Pillow's bound", data_uri(png_head(2 ** 31 - 1, 2 ** 31 - 1)), "too large"),
    ("an object", {"url": "data:image/png;base64," + GOOD}, "must be a data URI string"),
    ("an array", ["data:image/png;base64," + GOOD], "must be a data URI string"),
    ("a number", 7, "must be a data URI string"),
]


@pytest.mark.parametrize("route", ["query", "caption", "point", "detect"])
def test_bad_data_uris_are_refused_naming_image_url(moon_url, route):
    with httpx.Client(base_url=moon_url, timeout=30) as client:
        for case, uri, words in BAD_URIS:
            for stream in (False, True) if route in ("query", "caption") else (False,):
                body = {**BODIES[route], "image_url": uri, "stream": stream}
                reply = client.post(f"/v1/{route}", content=body_bytes(body),
                                    headers={"content-type": "application/json"})
                assert words in refused(reply, "image_url"), (case, reply.text[:300])
        serves_on(client)


def test_a_data_uri_is_read_whatever_the_case_of_its_scheme_and_base64(moon_url, moon):
    """RFC 2397 (with RFC 3986's scheme and ABNF's case-insensitive literals):
    ``DATA:`` and ``;BASE64`` spell the same URI. They were refused as "not a
    data URI ... this server fetches no URLs", which is false on both counts."""
    want = moon.query(png(IMAGE), "what is it")["answer"]
    with httpx.Client(base_url=moon_url, timeout=30) as client:
        for head in ("DATA:image/png;BASE64,", "Data:image/PNG;Base64,", "data:;base64,"):
            reply = client.post("/v1/query", json={"question": "what is it", "image_url": head + GOOD})
            assert reply.status_code == 200, (head, reply.text[:300])
            assert reply.json()["answer"] == want


# -- a text model asked for a spatial skill --------------------------------------

@pytest.mark.parametrize("skill", ["point", "detect", "segment"])
def test_a_spatial_skill_on_a_text_model_says_so_with_an_image_too(skill):
    """Given an image, a text model answered "this model takes no images; ask
    without one": asked again without one, it refused the skill for needing
    an image. The first answer must be the one that is true either way."""
    engine = fake_engine()
    try:
        with serving(engine) as url, httpx.Client(base_url=url, timeout=30) as client:
            for uri in (None, URI, "data:image/png;base64,@@"):
                body = {"object": "cat"} if uri is None else {"object": "cat", "image_url": uri}
                message = refused(client.post(f"/v1/{skill}", json=body), "image_url")
                assert f"{skill} needs an image, and this model takes no images" in message, (uri, message)
                assert "ask without one" not in message
            assert client.post("/v1/query", json={"question": "what"}).status_code == 200
    finally:
        engine.close()


# -- an image that fills the context ---------------------------------------------

@pytest.mark.parametrize("bound", [dict(image_length=512), dict(image_length=300, num_pages=64)],
                         ids=["max_context", "KV positions"])
def test_an_image_that_leaves_the_prompt_no_room_is_named_as_image_url(bound):
    """A vision-language model's image grows with its size (Qwen2-VL's). One
    that fills the context on its own was named ``prompt`` on caption (no
    field of moondream's API) and ``question`` / ``object`` elsewhere, though
    no text, however short, would fit after it."""
    engine = moon_engine(**bound)
    try:
        with serving(engine) as url, httpx.Client(base_url=url, timeout=30) as client:
            for route in ("query", "caption", "point", "detect"):
                for stream in (False, True) if route in ("query", "caption") else (False,):
                    reply = client.post(f"/v1/{route}", json={**BODIES[route], "stream": stream})
                    assert "positions" in refused(reply, "image_url"), (route, stream)
            # the text still carries the blame where it alone is too long
            reply = client.post("/v1/query", json={"question": "cat " * 600})
            assert "tokens" in refused(reply, "question")
    finally:
        engine.close()


def test_a_long_question_about_a_small_image_is_still_named_question(moon_url):
    with httpx.Client(base_url=moon_url, timeout=30) as client:
        reply = client.post("/v1/query", json={"question": "cat " * 600, "image_url": URI})
        assert "after the image's 5 positions" in refused(reply, "question")
        reply = client.post("/v1/point", json={"object": "cat " * 600, "image_url": URI})
        refused(reply, "object")
