"""Transformers vision-language models at their edges: an image the model's
own processor refuses (Qwen2-VL's past 200:1), or would resize past what
this server resizes to (LLaVA's, thin), is an InvalidRequest naming image,
a 422 over HTTP; an image too long for one prefill or the context is
named as the image; and a Qwen2-VL checkpoint as published (the text
settings at the top level of config.json) is served."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from bubblefree import Engine, InvalidRequest, Status
from tests import vlm_world
from tests.image_world import png
from tests.server_support import serving

OPTIONS = dict(device="cpu", page_size=16, num_pages=64, max_rows=4, max_seqs=8)
WAIT = 120
IMAGE, QUESTION = vlm_world.IMAGES[0], "what is in this image ?"


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    return vlm_world.checkpoint(tmp_path_factory.mktemp("qwen2_vl"), seed=3, text_type="qwen2", arch="qwen2_vl")


@pytest.fixture(scope="module")
def qwen(qwen_path):
    engine = Engine.from_pretrained(str(qwen_path), **OPTIONS)
    yield engine
    engine.close()


def _strip(width: int, height: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _answers(engine) -> bool:
    return engine.submit("query", image=IMAGE, question=QUESTION, max_tokens=3).result(WAIT).status \
        is Status.COMPLETED


@pytest.mark.parametrize("size", [(1, 500), (700, 3)])
def test_an_image_the_models_processor_refuses_is_refused_naming_image(qwen, size):
    with pytest.raises(InvalidRequest, match=rf"^image: the model's image processor refused it .*"
                                             rf"it is {size[0]}x{size[1]}"):
        qwen.submit("query", image=_strip(*size), question=QUESTION, max_tokens=3)
    assert _answers(qwen)


def test_over_http_it_is_a_422_naming_the_image_part(qwen):
    uri = "data:image/png;base64," + base64.b64encode(png(_strip(1, 500))).decode()
    with serving(qwen) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=WAIT, json={
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                      {"type": "text", "text": QUESTION}]}], "max_tokens": 3})
        assert reply.status_code == 422, reply.text[:300]
        assert reply.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert _answers(qwen)


def test_a_qwen2_vl_checkpoint_with_the_text_settings_at_the_top_is_served(tmp_path):
    path = vlm_world.checkpoint(tmp_path / "qwen", seed=3, text_type="qwen2", arch="qwen2_vl")
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    for key, value in text.items():
        if key not in ("model_type", "architectures", "dtype", "transformers_version"):
            config.setdefault(key, value)
    (path / "config.json").write_text(json.dumps(config))
    engine = Engine.from_pretrained(str(path), **OPTIONS)
    try:
        assert _answers(engine)
    finally:
        engine.close()


def test_a_thin_image_llavas_processor_would_blow_up_is_refused_before_it_is_resized(tmp_path):
    """LLaVA's processor resizes an image's shortest edge up before it
    crops: a 1 x 1,000,000 PNG of 4 KB became 336 x 336,000,000 pixels at
    full scale, gigabytes on the caller's thread (here, at the tiny
    processor's 28, a 1 x 30,000 strip would be 28 x 840,000)."""
    engine = Engine.from_pretrained(str(vlm_world.checkpoint(tmp_path / "llava", seed=3)), **OPTIONS)
    try:
        with pytest.raises(InvalidRequest, match=r"^image: 1x30000; the model's processor resizes its shortest "
                                                 r"edge to 28, which makes it 28x840000, past the 16777216 "):
            engine.submit("query", image=_strip(1, 30_000), question=QUESTION, max_tokens=3)
        assert _answers(engine)
    finally:
        engine.close()


def test_an_image_too_long_for_one_prefill_or_the_context_is_named_as_the_image(qwen, qwen_path):
    """No shorter text could fit: the refusal named the prompt (``question``,
    ``messages``), which the client cannot fix by shortening it."""
    big = _strip(300, 200)
    length = qwen.images.ref(big).length
    uri = "data:image/png;base64," + base64.b64encode(png(big)).decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                      {"type": "text", "text": "what"}]}], "max_tokens": 2}
    part = "messages[0].content[0].image_url.url"
    for bound, says in (({"max_prefill_tokens": length}, f"{length} positions, which leave no room for a prompt"),
                        ({"max_context": length + 1}, f"after the image's {length} positions")):
        engine = Engine.from_pretrained(str(qwen_path), **{**OPTIONS, **bound})
        try:
            if "max_prefill_tokens" in bound:
                with pytest.raises(InvalidRequest, match=f"^image: {says}"):
                    engine.submit("query", image=big, question="what", max_tokens=2)
            with serving(engine) as url:
                reply = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=WAIT)
                assert reply.status_code == 422 and reply.json()["error"]["param"] == part, reply.text[:300]
                assert says in reply.json()["error"]["message"]
                reply = httpx.post(f"{url}/v1/query", timeout=WAIT, json={
                    "image_url": uri, "question": "what", "settings": {"max_tokens": 2}})
                assert reply.status_code == 422 and reply.json()["error"]["param"] == "image_url", reply.text[:300]
        finally:
            engine.close()
