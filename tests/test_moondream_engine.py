"""moondream2 with random weights (the tiny config) through the public
Engine on the CPU: the same calls, results, refusals and guarantees as on
the simulated GPU, now through the real vision encoder, packed image
prefill, fused decode and region head. Pipelined equals blocking on image
requests (I8), every kind of image gives the same answer, an encoded image
is reused, cancels free everything, threads and asyncio agree; a
checkpoint directory written from the same weights loads to the same
answers; the moondream and OpenAI clients get them over HTTP."""

from __future__ import annotations

import asyncio
import base64
import threading

import moondream
import numpy as np
import openai
import pytest
from PIL import Image

from bubblefree import Engine, InvalidRequest, Status
from tests.image_world import png, tiny_checkpoint
from tests.serving_world import WAIT, wait_idle
from tests.server_support import serving
from tests.test_images import BAD

OPTIONS = dict(device="cpu", page_size=16, num_pages=400, max_rows=4, max_seqs=8,
               max_prefill_tokens=3200, min_graph_context=16)


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], axis=-1)
    return Image.fromarray(((base + rng.integers(0, 60, (height, width, 3))) % 256).astype(np.uint8))


SMALL = picture(200, 150, 1)  # one crop and the global view
WIDE = picture(700, 300, 2)  # several overlapping crops
CALLS = [("caption", {"length": "short", "max_tokens": 6}),
         ("query", {"question": "what is in this image", "max_tokens": 6}),
         ("point", {"object": "cat", "max_objects": 3}),
         ("detect", {"object": "dog", "max_objects": 2})]


@pytest.fixture(scope="module")
def engine():
    eng = Engine.moondream_random("tiny", seed=5, **OPTIONS)
    yield eng
    eng.close()


def outcomes(engine, calls):
    return [(h.result(WAIT).status, h.result(WAIT).tokens, h.result(WAIT).output)
            for h in engine.submit_many(calls)]


def test_pipelined_and_blocking_agree_on_image_requests(engine):
    calls = [(skill, dict(args, image=image)) for image in (SMALL, WIDE) for skill, args in CALLS]
    calls.append(("query", {"question": "what is in this image", "max_tokens": 6}))  # text only
    piped = outcomes(engine, calls)
    engine.pipelined = False
    try:
        blocking = outcomes(engine, calls)
    finally:
        engine.pipelined = True
    assert piped == blocking
    assert all(status is Status.COMPLETED for status, _, _ in piped)
    alone = [outcomes(engine, [call])[0] for call in calls]
    assert alone == piped  # a request's answer does not depend on who shares its steps
    shapes = [set(output) for _, _, output in piped]
    assert shapes[:4] == [{"caption"}, {"answer"}, {"points"}, {"objects"}]
    for _, tokens, output in piped:
        for p in output.get("points", ()):
            assert 0 <= p["x"] <= 1 and 0 <= p["y"] <= 1
        for b in output.get("objects", ()):
            assert 0 <= b["x_min"] <= b["x_max"] <= 1 and 0 <= b["y_min"] <= b["y_max"] <= 1


def test_every_kind_of_image_and_an_encoded_one_agree(engine, tmp_path):
    (tmp_path / "wide.png").write_bytes(png(WIDE))
    want = engine.detect(WIDE, "dog", settings={"max_objects": 2})
    encoded = engine.encode_image(WIDE)
    for image in (tmp_path / "wide.png", str(tmp_path / "wide.png"), png(WIDE), np.asarray(WIDE), encoded,
                  WIDE.convert("RGBA")):
        assert engine.detect(image, "dog", settings={"max_objects": 2}) == want
    for skill, args in CALLS:
        assert engine.run(skill, image=encoded, **args) == engine.run(skill, image=WIDE, **args)


def test_cancels_at_any_token_end_once_and_free_everything(engine):
    for cut in range(5):
        def listen(handle, token, cut=cut):
            if token is not None and len(handle.tokens) == cut:
                handle.cancel()
        handles = engine.submit_many([(skill, dict(args, image=SMALL, listener=listen)) for skill, args in CALLS])
        if cut == 0:
            for handle in handles:
                handle.cancel()
        for handle in handles:
            assert handle.result(WAIT).status in (Status.CANCELLED, Status.COMPLETED)
        wait_idle(engine)
    assert engine.point(SMALL, "cat", settings={"max_objects": 3}) == engine.point(SMALL, "cat", max_objects=3)


def test_threads_and_asyncio_agree_with_one_at_a_time(engine):
    alone = {skill: engine.run(skill, image=SMALL, **args) for skill, args in CALLS}
    got: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda s=s, a=a: got.__setitem__(s, engine.run(s, image=SMALL, **a)))
               for s, a in CALLS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert got == alone

    async def main():
        return await asyncio.gather(
            engine.acaption(SMALL, length="short", max_tokens=6),
            engine.aquery(SMALL, "what is in this image", max_tokens=6),
            engine.apoint(SMALL, "cat", settings={"max_objects": 3}),
            engine.adetect(SMALL, "dog", settings={"max_objects": 2}))
    assert asyncio.run(main()) == [alone[s] for s, _ in CALLS]


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_images_are_refused_and_the_engine_keeps_serving(engine, tmp_path, kind):
    with pytest.raises(InvalidRequest, match=r"^image: "):
        engine.point(BAD[kind](tmp_path), "cat")
    assert engine.point(SMALL, "cat", max_objects=3)["points"] is not None


def test_a_checkpoint_directory_loads_to_the_same_answers(engine, tmp_path):
    loaded = Engine.from_pretrained(tiny_checkpoint(tmp_path, seed=5), **OPTIONS)
    try:
        for skill, args in CALLS:
            assert loaded.run(skill, image=WIDE, **args) == engine.run(skill, image=WIDE, **args)
    finally:
        loaded.close()


def test_the_clients_over_http(engine):
    with serving(engine) as url:
        md = moondream.vl(endpoint=f"{url}/v1")
        sent = base64.b64decode(md.encode_image(SMALL).image_url.partition(",")[2])
        assert md.point(SMALL, "cat", settings={"max_objects": 3}) == {
            "points": engine.point(sent, "cat", max_objects=3)["points"]}
        assert md.detect(SMALL, "dog", settings={"max_objects": 2}) == {
            "objects": engine.detect(sent, "dog", max_objects=2)["objects"]}
        assert md.caption(SMALL, length="short", settings={"max_tokens": 6}) == engine.caption(
            sent, length="short", max_tokens=6)
        assert md.query(SMALL, "what is in this image", settings={"max_tokens": 6}) == engine.query(
            sent, "what is in this image", max_tokens=6)
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        uri = "data:image/png;base64," + base64.b64encode(png(SMALL)).decode()
        reply = oa.chat.completions.create(model="any", max_tokens=6, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is in this image"}, {"type": "image_url", "image_url": {"url": uri}}]}])
        assert reply.choices[0].message.content.strip() == engine.query(
            png(SMALL), "what is in this image", max_tokens=6)["answer"]
