"""Hostile HTTP input that once took the server down a worse path than a
refusal: a 500 for numbers, text and images it should have named, a reset
for the next request on a connection after a 500, the whole server frozen
while one large prompt was tokenized, and a refusal naming the wrong bound.
Each is refused naming its field, or served around, and the server serves
on."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
from typing import Any

import httpx
import pytest
from PIL import Image
from server_support import fake_engine, serving

from bubblefree.core import InvalidRequest
from bubblefree.images import load_image
from bubblefree.server import runs

HUGE = b"9" * 400  # a JSON integer past a float's range (>= 2**1024)
BOOM = "boom"  # a prompt the tokenizer below fails on, as a bug would


class GatedTokenizer:
    """The demo tokenizer, whose encoding can be held shut (to catch a
    request while its prompt is being tokenized) and fails on ``BOOM``."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.entered = threading.Event()  # an encode has begun
        self.open = threading.Event()
        self.open.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def encode(self, text: str) -> list[int]:
        if text.strip() == BOOM:
            raise RuntimeError("a bug in the tokenizer")
        self.entered.set()
        if not self.open.wait(10):
            raise TimeoutError("the test never opened the gate")
        return self._inner.encode(text)

    def prompt(self, frame: str, user: str) -> list[int]:
        return self.encode(frame)


@pytest.fixture(scope="module")
def engine():
    # 16 pages of 4 positions: the KV cache (64 positions) binds before the context (256).
    eng = fake_engine(num_pages=16)
    eng.skills.tokenizer = GatedTokenizer(eng.skills.tokenizer)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(engine):
    with serving(engine) as base:
        yield base


@pytest.fixture
def client(url):
    with httpx.Client(base_url=url, timeout=10) as c:
        yield c


def refused(reply: httpx.Response, field: str, status: int = 422) -> str:
    """The refusal's message, once it is checked to name ``field``."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}: "), error
    return error["message"]


def serves_on(client: httpx.Client) -> None:
    assert client.post("/v1/query", json={"question": "what"}).json()["answer"] == "the cat sits on the mat ."


# -- numbers past a float's range ----------------------------------------------

HUGE_NUMBERS = [
    ("/v1/completions", b'{"prompt": "a", "temperature": %s}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "top_p": -%s}', "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "temperature": %s}',
     "temperature"),
    ("/v1/query", b'{"question": "a", "settings": {"temperature": %s}}', "settings.temperature"),
    ("/v1/query", b'{"question": "a", "settings": {"top_p": %s}}', "settings.top_p"),
    ("/v1/completions", b'{"prompt": "a", "min_p": %s}', "min_p"),
    ("/v1/query", b'{"question": "a", "settings": {"min_p": -%s}}', "settings.min_p"),
]


@pytest.mark.parametrize("route,body,field", [
    ("/v1/completions", b'{"prompt": "a", "top_k": %s}', "top_k"),
    ("/v1/query", b'{"question": "a", "settings": {"top_k": %s}}', "settings.top_k"),
])
def test_a_top_k_of_hundreds_of_digits_is_refused_by_its_count_of_digits(client, route, body, field):
    message = refused(client.post(route, content=body % HUGE), field)
    assert message == f"{field}: must be an int in [0, 2**31 - 1] (0: no limit), got an integer of 400 digits"
    serves_on(client)


@pytest.mark.parametrize("route,body,field", HUGE_NUMBERS, ids=[f"{r} {f}" for r, _, f in HUGE_NUMBERS])
def test_an_integer_past_a_floats_range_is_refused_naming_its_field(client, route, body, field):
    """``math.isfinite`` converts an int to a float, and one of 400 digits
    overflowed: a 500 where ``1e999`` got a 422."""
    message = refused(client.post(route, content=body % HUGE), field)
    assert "must be finite" in message and "400 digits" in message
    serves_on(client)


def test_a_large_integer_within_a_floats_range_meets_the_engines_range_check(client):
    reply = client.post("/v1/completions", content=b'{"prompt": "a", "temperature": 1%s}' % (b"0" * 300))
    assert "must be 0 or in" in refused(reply, "temperature")


# -- a 500 and the connection it was sent on ----------------------------------

def test_a_500_closes_its_connection_so_the_next_request_opens_a_new_one(client):
    """Starlette raises a route's error again after sending the 500, and
    uvicorn closes the socket: without ``Connection: close`` the client kept
    it and its next request met a reset."""
    reply = client.post("/v1/completions", json={"prompt": BOOM})
    assert reply.status_code == 500 and reply.json()["error"]["param"] == "server", reply.text
    assert reply.headers["connection"] == "close"
    serves_on(client)  # the same client: a new connection
    serves_on(client)


# -- text no tokenizer can encode -----------------------------------------------

SURROGATES = [
    ("/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["a \\udc80"]}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", '
     b'"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b \\udfff"}]}]}',
     "messages[1].content[1].text"),
]


@pytest.mark.parametrize("route,body,field", SURROGATES, ids=[f for _, _, f in SURROGATES])
def test_a_lone_surrogate_in_a_prompt_or_message_is_refused_naming_it(client, route, body, field):
    """Valid JSON, but no UTF-8 form: a real tokenizer raised TypeError (a
    500); ``/v1/query`` already refused it in these words."""
    assert "is not valid text (surrogates not allowed at position" in refused(client.post(route, content=body),
                                                                              field)
    serves_on(client)


# -- images Pillow cannot decode -------------------------------------------------

def encoded(fmt: str, mode: str = "RGB", **options: Any) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (16, 12), (10, 20, 30, 255)[:len(mode)]).save(out, format=fmt, **options)
    return out.getvalue()


def webp_without_frame() -> bytes:
    data = bytearray(encoded("WEBP"))
    data[20:] = bytes(len(data) - 20)  # the VP8 frame zeroed: no decoder takes it
    return bytes(data)


def dds_of_unknown_format() -> bytes:
    data = bytearray(encoded("DDS", "RGBA"))
    struct.pack_into("<I", data, 80, 0x2000)  # the pixel format's flags: none Pillow knows
    return bytes(data)


def jpeg_with_bad_exif() -> bytes:
    """An upright-turning Orientation (6), and ImageWidth given as ASCII:
    ``exif_transpose`` fails on it with struct.error."""
    entries = [struct.pack("<HHII", 0x0100, 2, 3, int.from_bytes(b"ab\0\0", "little")),
               struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0)]
    tiff = (b"II*\0" + struct.pack("<I", 8) + struct.pack("<H", len(entries)) + b"".join(entries)
            + struct.pack("<I", 0))
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "JPEG", exif=b"Exif\0\0" + tiff)
    return out.getvalue()


BAD_IMAGES = {
    "PNG cut to 16 bytes": encoded("PNG")[:16],
    "PNG cut to 20 bytes": encoded("PNG")[:20],
    "JPEG cut to 6 bytes": encoded("JPEG")[:6],
    "WebP without its frame": webp_without_frame(),
    "DDS of an unknown format": dds_of_unknown_format(),
    "JPEG with malformed EXIF": jpeg_with_bad_exif(),
}


@pytest.mark.parametrize("data", BAD_IMAGES.values(), ids=BAD_IMAGES.keys())
def test_an_image_pillow_cannot_decode_is_refused_naming_image(data):
    with pytest.raises(InvalidRequest, match=r"^image: "):
        load_image(data)


@pytest.mark.parametrize("data", BAD_IMAGES.values(), ids=BAD_IMAGES.keys())
def test_an_image_pillow_cannot_decode_is_a_422_naming_image_url(client, data):
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    refused(client.post("/v1/query", json={"question": "what", "image_url": url}), "image_url")
    serves_on(client)


# -- tokenizing off the event loop ------------------------------------------------

SLOW = [
    ("/v1/completions", {"prompt": "cat"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "cat"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "cat"}], "stream": True}),
    ("/v1/query", {"question": "cat"}),
    ("/v1/query", {"question": "cat", "stream": True}),
]


@pytest.mark.parametrize("route,body", SLOW, ids=[f"{r} stream={b.get('stream', False)}" for r, b in SLOW])
def test_a_prompt_being_tokenized_leaves_the_server_answering(engine, url, route, body):
    """A prompt of megabytes takes seconds to tokenize; on the event loop
    it froze every client for that long. Here the encode is held shut
    until ``/health`` has answered: on the loop, ``/health`` would wait for it."""
    gate = engine.skills.tokenizer
    gate.entered.clear()
    gate.open.clear()
    replies: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: replies.append(httpx.post(url + route, json=body, timeout=20)))
    asking.start()
    try:
        assert gate.entered.wait(10), "the request never reached the tokenizer"
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
    finally:
        gate.open.set()
        asking.join(20)
    assert replies and replies[0].status_code == 200, replies and replies[0].text
    assert "mat" in replies[0].text  # the answer, whole or in chunks


def test_a_submit_whose_caller_is_cancelled_cancels_its_request_once_in():
    """The server cancels a route's task on shutdown; the submit in its
    worker thread runs on, and the request it makes has nobody to read it."""
    class Handle:
        cancelled = False

        def cancel(self) -> bool:
            Handle.cancelled = True
            return True

    begun, release = threading.Event(), threading.Event()

    def submit() -> Handle:
        begun.set()
        release.wait(10)
        return Handle()

    async def scenario() -> None:
        task = asyncio.ensure_future(runs._submitted(submit))
        while not begun.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(500):
            if Handle.cancelled:
                return
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert Handle.cancelled


# -- the bound a refusal names ------------------------------------------------------

def test_a_prompt_past_the_kv_caches_room_names_max_positions_not_max_context(client):
    message = refused(client.post("/v1/completions", json={"prompt": "cat " * 70}), "prompt")
    assert "is 70 tokens; the KV cache's max_positions is 64" in message


def test_max_tokens_past_the_kv_caches_room_names_max_positions(client):
    message = refused(client.post("/v1/completions", json={"prompt": "cat " * 10, "max_tokens": 100}),
                      "max_tokens")
    assert message.startswith("max_tokens: 100 after a 10-token prompt exceeds the room of 55 tokens "
                              "(max_positions 64)"), message


def test_a_prompt_past_the_context_still_names_max_context():
    eng = fake_engine(num_pages=128)  # 512 positions: the context (256) binds
    try:
        with pytest.raises(InvalidRequest, match="is 300 tokens; the model's max_context is 256"):
            eng.submit("complete", prompt=[3] * 300)
    finally:
        eng.close()
