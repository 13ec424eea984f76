"""Image skills over HTTP on an image model (the simulated GPU with a region
head and moondream's prompts), through the clients people use: Moondream's
and OpenAI's, unchanged. Each answer equals the engine's own for the image
the server received."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import re
import urllib.error

import httpx
import moondream
import openai
import pytest
from PIL import Image

from tests.server_support import serving
from tests.image_world import expected, moon, picture, png  # noqa: F401 (moon: a fixture)

KEY = "sesame"
IMAGE = picture(5, 64, 48)


@pytest.fixture(scope="module")
def url(moon):
    with serving(moon, api_key=KEY) as base:
        yield base


@pytest.fixture
def md(url):
    return moondream.vl(api_key=KEY, endpoint=f"{url}/v1")


@pytest.fixture
def oa(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=20)


def sent(image: Image.Image) -> bytes:
    """The bytes Moondream's client sends for ``image`` (a JPEG)."""
    uri = moondream.vl(api_key=KEY, endpoint="http://unused").encode_image(image).image_url
    return base64.b64decode(uri.partition(",")[2])


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def refusal(err: urllib.error.HTTPError) -> dict:
    return json.loads(err.read())["error"]


def test_moondream_client_caption_and_query(md, moon):
    jpeg = sent(IMAGE)
    assert md.caption(IMAGE, length="short") == moon.caption(jpeg, length="short")
    assert md.caption(IMAGE) == moon.caption(jpeg)
    assert md.query(IMAGE, "what is the cat on") == moon.query(jpeg, "what is the cat on")
    pieces = list(md.query(IMAGE, "what is the cat on", stream=True)["answer"])
    assert "".join(pieces).strip() == moon.query(jpeg, "what is the cat on")["answer"]
    pieces = list(md.caption(IMAGE, stream=True, settings={"max_tokens": 5})["caption"])
    assert "".join(pieces).strip() == moon.caption(jpeg, max_tokens=5)["caption"]


def test_moondream_client_point_and_detect(md, moon):
    jpeg = sent(IMAGE)
    points = md.point(IMAGE, "cat", settings={"max_objects": 3})
    assert points == {"points": moon.point(jpeg, "cat", max_objects=3)["points"]}
    # ... and both are the fake model's own answer for those bytes, a real list of points
    want = expected(moon, "point", image=jpeg, object="cat", max_objects=3)[1]["points"]
    assert points["points"] == want and want
    boxes = md.detect(IMAGE, "dog", settings={"max_objects": 2, "temperature": 0.5, "seed": 9})
    assert boxes == {"objects": moon.detect(jpeg, "dog", settings={"max_objects": 2, "temperature": 0.5,
                                                                        "seed": 9})["objects"]}
    assert all(0 <= b["x_min"] <= b["x_max"] <= 1 for b in boxes["objects"])


def test_a_text_only_query_on_the_image_model(md, moon):
    assert md.query(question="what is the cat on") == moon.query(question="what is the cat on")


def test_segment_and_missing_images_are_refused_clearly(md, url):
    with pytest.raises(urllib.error.HTTPError) as caught:
        md.segment(IMAGE, "cat")
    assert caught.value.code == 422
    error = refusal(caught.value)
    assert error["param"] == "skill" and "no segment skill" in error["message"]
    headers = {"X-Moondream-Auth": KEY}
    for route, body, field, words in [
        ("segment", {"object": "cat"}, "skill", "no segment skill"),  # not "image_url: is required"
        ("caption", {}, "image_url", "is required"),
        ("point", {"object": "cat"}, "image_url", "is required"),
        ("detect", {"object": "cat", "stream": True}, "stream", "answers whole"),
        ("point", {"object": "cat", "image_url": data_uri(png(IMAGE)), "spatial_refs": [[0.1, 0.2]]},
         "spatial_refs", "point takes none"),
        ("query", {"question": "a", "image_url": data_uri(png(IMAGE)), "spatial_refs": [[0.1, 2]]},
         "spatial_refs[0]", "numbers in [0, 1]"),
        ("query", {"question": "a", "spatial_refs": [[0.1, 0.2]]}, "spatial_refs", "refer to an image"),
        ("point", {"object": "cat", "image_url": data_uri(png(IMAGE)), "settings": {"max_objects": 0}},
         "settings.max_objects", ">= 1"),
        ("caption", {"image_url": data_uri(png(IMAGE)), "settings": {"max_objects": 2}},
         "settings.max_objects", "unknown field"),
        ("query", {"question": "a", "image_url": data_uri(b"not an image")}, "image_url", "not an image"),
        ("query", {"question": "a", "image_url": "data:image/png;base64,@@"}, "image_url", "base64"),
        ("detect", {"object": "a", "image_url": data_uri(png(picture(0, 1, 1)))[:40]}, "image_url", ""),
    ]:
        reply = httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=20)
        assert reply.status_code == 422, (route, body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == field and words in error["message"], error
    assert md.point(IMAGE, "cat")["points"] is not None  # still serving


def test_moondreams_client_sends_spatial_refs_with_a_query(md, moon):
    refs = [[0.5, 0.25], [0.1, 0.1, 0.4, 0.3]]
    want = moon.query(sent(IMAGE), "what is there", spatial_refs=refs)
    assert md.query(IMAGE, "what is there", spatial_refs=refs) == want
    assert want != moon.query(sent(IMAGE), "what is there")


def test_openai_chat_with_an_image_part(oa, moon):
    image = png(IMAGE)
    parts = [{"type": "text", "text": "what is the cat on"},
             {"type": "image_url", "image_url": {"url": data_uri(image)}}]
    reply = oa.chat.completions.create(model="any", messages=[{"role": "user", "content": parts}])
    want = moon.query(image, "what is the cat on")["answer"]
    assert reply.choices[0].message.content.strip() == want
    chunks = oa.chat.completions.create(model="any", stream=True,
                                        messages=[{"role": "user", "content": parts}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == want
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oa.chat.completions.create(model="any", messages=[{"role": "user", "content": parts + parts[1:]}])
    assert "messages[0].content[2].image_url.url: one image a request" in str(caught.value)
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oa.chat.completions.create(model="any", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(b"GIF89a")}}]}])
    assert "messages[0].content[0].image_url.url: the data is not an image" in str(caught.value)


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_the_images_positions_as_prompt(oa, stream):
    """They are what the request takes of the context, and OpenAI counts an
    image in ``prompt_tokens``; it counted only the text's tokens, so a
    question with an image reported fewer than the same without one."""
    parts = [{"type": "text", "text": "what is the cat on"},
             {"type": "image_url", "image_url": {"url": data_uri(png(IMAGE))}}]
    with pytest.raises(openai.UnprocessableEntityError) as caught:  # its refusal counts both
        oa.chat.completions.create(model="any", max_tokens=10**6, messages=[{"role": "user", "content": parts}])
    text, image = map(int, re.search(r"after a (\d+)-token prompt after the image's (\d+) positions",
                                     str(caught.value)).groups())
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    reply = oa.chat.completions.create(model="any", max_tokens=3, messages=[{"role": "user", "content": parts}],
                                       **options)
    usage = [c for c in reply if c.usage][-1].usage if stream else reply.usage
    assert usage.prompt_tokens == text + image, (usage, text, image)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_clients_at_once_each_get_the_answer_for_their_image(url, moon):
    images = [picture(seed, 40 + seed, 30) for seed in range(6)]

    def ask(image):
        client = moondream.vl(api_key=KEY, endpoint=f"{url}/v1")
        return client.point(image, "cat"), client.query(image, "is there a dog")

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(ask, images))
    for image, (points, answer) in zip(images, got):
        jpeg = sent(image)
        assert points == {"points": moon.point(jpeg, "cat")["points"]}
        assert answer == moon.query(jpeg, "is there a dog")


@pytest.mark.parametrize("spell", [
    lambda b64: "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76)),  # the base64 command's lines
    lambda b64: b64.rstrip("="),  # no padding
    lambda b64: " ".join(b64[i:i + 4] for i in range(0, len(b64), 4)) + "\r\n",
], ids=["wrapped", "unpadded", "spaced"])
def test_base64_as_browsers_read_it_is_an_image(url, moon, spell):
    """Line-wrapped base64 (the ``base64`` command's own output) and base64
    without its padding, which browsers read in a data URI, were refused
    as "not valid base64"."""
    data = png(IMAGE)
    b64 = base64.b64encode(data).decode()
    assert b64.endswith("="), "the case needs a PNG whose base64 is padded"
    body = {"image_url": "data:image/png;base64," + spell(b64), "question": "what is the cat on"}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=20) as client:
        reply = client.post("/v1/query", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["answer"] == moon.query(data, "what is the cat on")["answer"]


@pytest.mark.parametrize("data", ["iVBO*w0K", "iVBORw0KG", "iVB\u00a0ORw0K"],
                         ids=["not base64", "a lone sixth bit", "a non-ASCII space"])
def test_base64_that_no_padding_or_space_explains_is_still_refused(url, data):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=20) as client:
        reply = client.post("/v1/query", json={"image_url": "data:image/png;base64," + data,
                                               "question": "what"})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["message"] == "image_url: not valid base64"

