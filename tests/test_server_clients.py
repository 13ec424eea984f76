"""The clients people already use, unchanged, against the server: Moondream's
(its HTTP client) and OpenAI's."""

from __future__ import annotations

import base64
import io
import json
import urllib.error

import moondream
import openai
import pytest
from PIL import Image

from server_support import fake_engine, serving

KEY = "sesame"
ANSWER_TEXT = "the cat sits on the mat ."


@pytest.fixture(scope="module")
def url():
    engine = fake_engine()
    with serving(engine, api_key=KEY) as base:
        yield base
    engine.close()


@pytest.fixture
def md(url):
    return moondream.vl(api_key=KEY, endpoint=f"{url}/v1")


@pytest.fixture
def oa(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=20)


def test_moondream_query(md):
    assert md.query(question="what is the cat on")["answer"] == ANSWER_TEXT


def test_moondream_query_streamed(md):
    pieces = list(md.query(question="what is the cat on", stream=True)["answer"])
    assert len(pieces) > 1 and "".join(pieces).strip() == ANSWER_TEXT


def test_moondream_settings_reach_the_engine(md):
    answer = md.query(question="what", settings={"max_tokens": 2, "temperature": 0.0})["answer"]
    assert answer == "the cat"


def _refusal(err: urllib.error.HTTPError) -> dict:
    return json.loads(err.read())["error"]


@pytest.mark.parametrize("call", ["caption", "point", "detect", "segment", "query"])
def test_moondream_image_requests_are_refused_naming_the_image(md, call):
    image = Image.new("RGB", (16, 16), "red")
    args = {"question": "what"} if call == "query" else {} if call == "caption" else {"object": "cat"}
    with pytest.raises(urllib.error.HTTPError) as caught:
        getattr(md, call)(image, **args)
    assert caught.value.code == 422
    error = _refusal(caught.value)
    assert error["param"] == "image_url" and "takes no images" in error["message"]
    assert md.query(question="still there")["answer"] == ANSWER_TEXT


def test_moondream_wrong_key_is_refused(url):
    with pytest.raises(urllib.error.HTTPError) as caught:
        moondream.vl(api_key="wrong", endpoint=f"{url}/v1").query(question="what")
    assert caught.value.code == 401


def test_openai_chat(oa):
    reply = oa.chat.completions.create(model="any", messages=[{"role": "user", "content": "what"}])
    assert reply.choices[0].message.content.strip() == ANSWER_TEXT
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 7  # the words; not the EOS that ended them
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


def test_openai_chat_streamed_with_usage(oa):
    chunks = list(oa.chat.completions.create(model="any", stream=True, max_tokens=3,
                                             stream_options={"include_usage": True},
                                             messages=[{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": [
                                                           {"type": "text", "text": "what"}]}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "the cat sits"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3


def test_openai_completion_with_stop(oa):
    reply = oa.completions.create(model="any", prompt="the", stop=[" on", "mat"], max_tokens=20)
    assert reply.choices[0].text.strip() == "the cat sits"
    assert reply.choices[0].finish_reason == "stop"


def test_openai_completion_streamed_with_stop_split_over_pieces(oa):
    chunks = oa.completions.create(model="any", prompt="the", stop="sits on", stream=True)
    assert "".join(c.choices[0].text for c in chunks).strip() == "the cat"


def test_openai_models(oa):
    assert [m.id for m in oa.models.list()] == ["bubblefree"]


def test_openai_image_part_is_refused(oa):
    # A real image (the server reads it before refusing it on a text model).
    tiny = io.BytesIO()
    Image.new("RGB", (2, 2)).save(tiny, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(tiny.getvalue()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oa.chat.completions.create(model="any", messages=[{"role": "user", "content": [part]}])
    assert "messages[0].content[0].image_url.url: this model takes no images" in str(caught.value)


def test_openai_bad_sampling_value_names_it(oa):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        oa.chat.completions.create(model="any", temperature=-1, messages=[{"role": "user", "content": "x"}])
    assert "temperature: must be 0 or in" in str(caught.value)
