"""Bad HTTP input gets a 4xx JSON error naming the field, and the server
keeps serving. The cases are the table in docs/server.md, row for row."""

from __future__ import annotations

import base64
import io
import pathlib
import re
import struct
import zlib

import httpx
import pytest
from PIL import Image

from server_support import fake_engine, serving

def png(width: int, height: int, pixels: bool = True) -> str:
    """A base64 PNG of ``width`` x ``height``: a real one, or (``pixels=False``)
    its header and a first row's worth of data, which is all a pixel limit
    needs to read (Pillow 13 no longer opens a header alone)."""
    if pixels:
        out = io.BytesIO()
        Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
        return base64.b64encode(out.getvalue()).decode()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(1 + 3 * width))) + chunk(b"IEND", b"")
    return base64.b64encode(b"\x89PNG\r\n\x1a\n" + data).decode()


PNG = png(4, 3)
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "server.md"


def chat(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "what"}], **extra}


# (case, method, route, body: dict or raw bytes, status, field the error names)
CASES = [
    ("malformed JSON", "POST", "/v1/query", b'{"question": ', 400, "body"),
    ("empty body", "POST", "/v1/query", b"", 400, "body"),
    ("body not UTF-8", "POST", "/v1/query", b"\xff\xfe{}", 400, "body"),
    ("NaN literal", "POST", "/v1/query", b'{"question": "a", "settings": {"temperature": NaN}}', 400, "body"),
    ("nesting too deep", "POST", "/v1/query", b"[" * 100_000 + b"]" * 100_000, 400, "body"),
    ("body not an object", "POST", "/v1/query", b"[1, 2]", 422, "body"),
    ("missing field", "POST", "/v1/query", {}, 422, "question"),
    ("wrong type", "POST", "/v1/query", {"question": 3}, 422, "question"),
    ("unknown field", "POST", "/v1/query", {"question": "a", "colour": "red"}, 422, "colour"),
    ("unknown setting", "POST", "/v1/query", {"question": "a", "settings": {"temp": 1}}, 422, "settings.temp"),
    ("settings not an object", "POST", "/v1/query", {"question": "a", "settings": [1]}, 422, "settings"),
    ('temperature "hot"', "POST", "/v1/query", {"question": "a", "settings": {"temperature": "hot"}},
     422, "settings.temperature"),
    ("temperature 1e999", "POST", "/v1/query", b'{"question": "a", "settings": {"temperature": 1e999}}',
     422, "settings.temperature"),
    ("temperature -1", "POST", "/v1/chat/completions", chat(temperature=-1), 422, "temperature"),
    ("top_p 0", "POST", "/v1/chat/completions", chat(top_p=0), 422, "top_p"),
    ("seed -1", "POST", "/v1/completions", {"prompt": "a", "seed": -1}, 422, "seed"),
    ("top_k -2", "POST", "/v1/chat/completions", chat(top_k=-2), 422, "top_k"),
    ("top_k 2**31", "POST", "/v1/completions", {"prompt": "a", "top_k": 2**31}, 422, "top_k"),
    ("min_p 1.5", "POST", "/v1/chat/completions", chat(min_p=1.5), 422, "min_p"),
    ('top_k "ten"', "POST", "/v1/query", {"question": "a", "settings": {"top_k": "ten"}}, 422, "settings.top_k"),
    ("max_tokens 0", "POST", "/v1/query", {"question": "a", "settings": {"max_tokens": 0}},
     422, "settings.max_tokens"),
    ("max_tokens true", "POST", "/v1/chat/completions", chat(max_tokens=True), 422, "max_tokens"),
    ("max_tokens past the model's room", "POST", "/v1/query",
     {"question": "a", "settings": {"max_tokens": 10**6}}, 422, "settings.max_tokens"),
    ("max_tokens past the room (OpenAI)", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 10**6},
     422, "max_tokens"),
    ('stream "yes"', "POST", "/v1/query", {"question": "a", "stream": "yes"}, 422, "stream"),
    ("caption length unknown", "POST", "/v1/caption", {"length": "huge"}, 422, "length"),
    ("reasoning asked", "POST", "/v1/query", {"question": "a", "reasoning": True}, 422, "reasoning"),
    ("invalid base64", "POST", "/v1/query", {"question": "a", "image_url": "data:image/png;base64,@@@"},
     422, "image_url"),
    ("data not an image", "POST", "/v1/query",
     {"question": "a", "image_url": "data:image/png;base64," + base64.b64encode(b"hello").decode()},
     422, "image_url"),
    ("image over the pixel limit", "POST", "/v1/query",
     {"question": "a", "image_url": "data:image/png;base64," + png(10_000, 10_000, pixels=False)},
     422, "image_url"),
    ("image as a web URL", "POST", "/v1/query", {"question": "a", "image_url": "http://example.com/a.png"},
     422, "image_url"),
    ("image on a text model", "POST", "/v1/query", {"question": "a", "image_url": f"data:image/png;base64,{PNG}"},
     422, "image_url"),
    ("spatial skill on a text model", "POST", "/v1/detect", {"object": "cat"}, 422, "image_url"),
    ("messages missing", "POST", "/v1/chat/completions", {"model": "m"}, 422, "messages"),
    ("unknown role", "POST", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, 422, "messages[0].role"),
    ("unknown content part", "POST", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     422, "messages[0].content[0].type"),
    ("five stop strings", "POST", "/v1/completions", {"prompt": "a", "stop": list("abcde")}, 422, "stop"),
    ("a stop string of 1,001 characters", "POST", "/v1/completions", {"prompt": "a", "stop": "s" * 1001},
     422, "stop"),
    ("n = 2", "POST", "/v1/chat/completions", chat(n=2), 422, "n"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 422, "prompt"),
    ("token id past the vocabulary", "POST", "/v1/completions", {"prompt": [3, 10**6]}, 422, "prompt"),
    ("prompt of no token", "POST", "/v1/completions", {"prompt": "  "}, 422, "prompt"),
    ("stream_options without stream", "POST", "/v1/chat/completions",
     chat(stream_options={"include_usage": True}), 422, "stream_options"),
    ("max_completion_tokens past the room", "POST", "/v1/chat/completions", chat(max_completion_tokens=10**6),
     422, "max_completion_tokens"),
    ("unknown route", "GET", "/v1/nothing", None, 404, None),
    ("wrong method", "GET", "/v1/query", None, 405, None),
]


@pytest.fixture(scope="module")
def client():
    engine = fake_engine()
    with serving(engine) as url, httpx.Client(base_url=url, timeout=20) as c:
        yield c
    engine.close()


@pytest.mark.parametrize("case,method,route,body,status,field", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_field(client, case, method, route, body, status, field):
    kwargs = {"content": body} if isinstance(body, bytes) else {} if body is None else {"json": body}
    reply = client.request(method, route, **kwargs)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status
    assert error["param"] == field
    if field is not None:
        assert error["message"].startswith(f"{field}: ") or error["message"].startswith(f"{field}, ")
    # and the server keeps serving
    assert client.post("/v1/query", json={"question": "what"}).json()["answer"] == "the cat sits on the mat ."


def test_an_image_over_the_pixel_limit_is_refused_from_its_header(client):
    """The pixel limit reads the header: the image's pixels are never
    decoded (its data here is one row of a 10,000-row image)."""
    reply = client.post("/v1/query", json={
        "question": "a", "image_url": "data:image/png;base64," + png(10_000, 10_000, pixels=False)})
    assert reply.status_code == 422, reply.text
    assert "10000x10000 is 100000000 pixels, over the limit of 50000000" in reply.json()["error"]["message"]


def test_the_documented_table_is_the_tested_one():
    rows = re.findall(r"^\| (.+?) \| `(\w+) (\S+)` \| (\d{3}) \|", DOC.read_text(), re.MULTILINE)
    assert [(case, method, route, int(status)) for case, method, route, status in rows] == \
        [(c[0], c[1], c[2], c[4]) for c in CASES]
