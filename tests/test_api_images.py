"""The image API (``bubblefree.calls``) through the public Engine on the
simulated GPU: moondream's signatures and result shapes, every kind of image
input, pipelined against blocking against the model's own expectation,
cancels at any moment, threads, asyncio, and bad values of every type."""

from __future__ import annotations

import asyncio
import fractions
import gc
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bubblefree import EncodedImage, InvalidRequest, RequestFailed, SamplingParams, Status
from bubblefree.core import ImageRef
from tests.image_world import (  # noqa: F401 (loc, moon: fixtures)
    KINDS, MOON_TOK, as_kind, expected, loc, loc_engine, moon, moon_engine, picture)
from tests.serving_world import WAIT, Gate, wait_idle, wait_until
from tests.test_images import BAD

PICTURES = [picture(seed, 40 + 8 * seed, 30 + 4 * seed) for seed in range(3)]
SAMPLINGS = [None, {"temperature": 0.8, "seed": 7}, {"temperature": 1.3, "top_k": 3, "min_p": 0.05, "seed": 2}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


def outcome(handle):
    result = handle.result(WAIT)
    return result.status, result.tokens, result.output


# -- shapes and kinds ----------------------------------------------------------

def test_moondream_signatures_give_moondream_shapes(moon, folder):
    image = PICTURES[0]
    caption = moon.caption(image, length="short")
    assert set(caption) == {"caption"} and isinstance(caption["caption"], str)
    answer = moon.query(image, "what is the cat on")
    assert set(answer) == {"answer"} and isinstance(answer["answer"], str)
    points = moon.point(image, "cat", settings={"max_objects": 4})["points"]
    assert points and len(points) <= 4
    assert all(set(p) == {"x", "y"} and 0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
    boxes = moon.detect(image, "dog", settings={"max_objects": 3})["objects"]
    assert boxes and len(boxes) <= 3
    for b in boxes:
        assert set(b) == {"x_min", "y_min", "x_max", "y_max"}
        assert 0 <= b["x_min"] <= b["x_max"] <= 1 and 0 <= b["y_min"] <= b["y_max"] <= 1
    # Each equals what the model computes for it, with the image's prefix.
    assert points == expected(moon, "point", image=image, object="cat", max_objects=4)[1]["points"]
    assert answer == expected(moon, "query", image=image, question="what is the cat on")[1]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_image_gets_the_same_answer(moon, folder, kind):
    image = as_kind(moon, PICTURES[1], kind, folder)
    want = expected(moon, "detect", image=PICTURES[1], object="cat", max_objects=3)[1]
    assert moon.detect(image, "cat", settings={"max_objects": 3}) == want
    assert moon.run("detect", image=image, object="cat", max_objects=3) == want
    other = moon.detect(PICTURES[2], "cat", settings={"max_objects": 3})
    assert other != want  # the image is read: another picture, other boxes


def test_an_encoded_image_serves_many_questions(moon):
    encoded = moon.encode_image(PICTURES[2])
    assert isinstance(encoded, EncodedImage) and (encoded.width, encoded.height) == PICTURES[2].size
    assert moon.encode_image(encoded) is encoded
    for skill, args in (("caption", {"length": "normal"}), ("query", {"question": "is there a dog"}),
                        ("point", {"object": "cat"}), ("detect", {"object": "dog"})):
        assert moon.run(skill, image=encoded, **args) == moon.run(skill, image=PICTURES[2], **args)


def test_text_only_query_on_moondream_begins_with_bos(moon):
    answer = moon.query(question="what is the cat on", max_tokens=6)
    assert answer == expected(moon, "query", question="what is the cat on", max_tokens=6)[1]
    handle = moon.submit("query", question="what is the cat on", max_tokens=6)
    assert handle.request.prompt[0] == moon.skills.tokenizer.templates.bos_id
    assert handle.request.image is None and handle.result(WAIT).status is Status.COMPLETED


def test_streaming_forms(moon):
    image = PICTURES[0]
    pieces = moon.query(image, "what is the cat on", stream=True, max_tokens=12)["answer"]
    assert "".join(pieces).strip() == moon.query(image, "what is the cat on", max_tokens=12)["answer"]
    pieces = moon.caption(image, stream=True, max_tokens=12)["caption"]
    assert "".join(pieces).strip() == moon.caption(image, max_tokens=12)["caption"]


def test_a_location_token_model_takes_images_for_every_skill(loc, folder):
    image = as_kind(loc, PICTURES[0], "path", folder)
    for skill, args in (("segment", {"object": "cat"}), ("point", {"object": "cat"}),
                        ("caption", {"length": "long"}), ("query", {"question": "is there a cat"})):
        want = expected(loc, skill, image=PICTURES[0], max_tokens=30, **args)
        loc.pipelined = False
        try:
            blocking = loc.submit(skill, image=image, max_tokens=30, **args).result(WAIT)
        finally:
            loc.pipelined = True
        piped = loc.submit(skill, image=image, max_tokens=30, **args).result(WAIT)
        assert (piped.tokens, piped.output) == (blocking.tokens, blocking.output) == want
    # Without an image it is the text model it was, prompts and all.
    assert loc.point("cat", max_tokens=6) == expected(loc, "point", object="cat", max_tokens=6)[1]
    assert loc.caption("short", max_tokens=6) == expected(loc, "caption", length="short", max_tokens=6)[1]


# -- pipelined against blocking against the model -----------------------------

CALLS = {"caption": {"length": "short"}, "query": {"question": "what is the cat on"},
         "point": {"object": "cat", "max_objects": 3}, "detect": {"object": "dog", "max_objects": 2}}

call = st.tuples(st.sampled_from(sorted(CALLS) + ["text query"]), st.integers(0, 2),
                 st.sampled_from(KINDS), st.integers(1, 16), st.sampled_from(range(len(SAMPLINGS))))


def submit_all(engine, drawn, folder):
    calls = []
    for skill, picture_at, kind, max_tokens, sampling in drawn:
        args = dict(CALLS["query" if skill == "text query" else skill])
        image = None if skill == "text query" else as_kind(engine, PICTURES[picture_at], kind, folder)
        calls.append(("query" if skill == "text query" else skill,
                      dict(args, image=image, max_tokens=max_tokens, sampling=SAMPLINGS[sampling])))
    return calls, engine.submit_many(calls)


@settings(deadline=None, max_examples=40)
@given(st.lists(call, min_size=1, max_size=6))
def test_pipelined_and_blocking_give_the_models_tokens_and_values(moon, folder, drawn):
    calls, piped = submit_all(moon, drawn, folder)
    piped = [outcome(h) for h in piped]
    moon.pipelined = False
    try:
        blocking = [outcome(h) for h in moon.submit_many(calls)]
    finally:
        moon.pipelined = True
    assert piped == blocking  # I8, with images and values
    for (skill, args), (status, tokens, output) in zip(calls, piped):
        image = args.pop("image")
        want = expected(moon, skill, image=image, **args)
        assert status is Status.COMPLETED and (tokens, output) == want


# -- cancels -------------------------------------------------------------------

@settings(deadline=None, max_examples=40)
@given(st.lists(call, min_size=1, max_size=6), st.data())
def test_a_cancel_at_any_moment_ends_the_request_once_and_frees_everything(moon, folder, drawn, data):
    cuts = data.draw(st.lists(st.integers(0, 6), min_size=len(drawn), max_size=len(drawn)), label="cuts")
    ends: dict[int, int] = {}
    lock = threading.Lock()

    def listener(cut):
        def listen(handle, token):
            if token is None:
                with lock:
                    ends[handle.request_id] = ends.get(handle.request_id, 0) + 1
            elif len(handle.tokens) == cut:
                handle.cancel()  # on the decode thread, between ticks
        return listen

    built, _ = submit_all(moon, drawn, folder)
    handles = moon.submit_many((skill, dict(args, listener=listener(cut)))
                               for (skill, args), cut in zip(built, cuts))
    for handle, cut in zip(handles, cuts):
        if cut == 0:
            handle.cancel()  # from this thread: before, during or after its image prefill
    for handle, (skill, args) in zip(handles, built):
        status, tokens, output = outcome(handle)
        want_tokens, want_output = expected(moon, skill, **args)
        if status is Status.CANCELLED:  # what it holds is the start of the whole answer
            assert tokens == want_tokens[:len(tokens)]
            key = next(iter(want_output))
            if isinstance(want_output[key], list):  # whole objects only
                assert output[key] == want_output[key][:len(output[key])]
            else:
                assert set(output) == {key} and isinstance(output[key], str)
        else:
            assert status is Status.COMPLETED and (tokens, output) == (want_tokens, want_output)
    wait_until(lambda: len(ends) == len(handles), "every end listener called")
    assert set(ends.values()) == {1}  # I7
    wait_idle(moon)  # I6: every page and row slot back


def test_a_cancel_while_the_image_prefill_is_in_flight():
    gate = Gate()
    engine = moon_engine(gate=gate)
    try:
        gate.arm(at=0)  # held while sampling the prefill's first token
        handle = engine.submit("query", image=PICTURES[0], question="is the sky blue", max_tokens=8)
        gate.wait_reached()
        assert handle.cancel()
        gate.open()
        assert handle.result(WAIT).status is Status.CANCELLED and handle.result(WAIT).tokens == ()
        wait_idle(engine)
        assert engine.point(PICTURES[0], "cat") == expected(engine, "point", image=PICTURES[0], object="cat")[1]
    finally:
        gate.open()
        engine.close()


# -- threads and asyncio ------------------------------------------------------

def test_threads_batch_image_requests_and_each_gets_its_own_answer(moon, folder):
    jobs = [(skill, i % 3, KINDS[i % len(KINDS)]) for i, skill in enumerate(sorted(CALLS) * 3)]
    results: dict[int, dict] = {}
    before = len(moon.core.trace)

    def ask(i, skill, picture_at, kind):
        image = as_kind(moon, PICTURES[picture_at], kind, folder)
        results[i] = moon.run(skill, image=image, **CALLS[skill])

    threads = [threading.Thread(target=ask, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    for i, (skill, picture_at, _) in enumerate(jobs):
        assert results[i] == expected(moon, skill, image=PICTURES[picture_at], **CALLS[skill])[1]
    steps = [e for e in moon.core.trace[before:] if e[0] == "launch"]
    assert any(e[2] == "image_prefill" for e in steps)
    assert max(len(e[4]) for e in steps if e[2] == "decode") > 1, "image requests never shared a step"


def test_asyncio_forms_agree_with_the_blocking_ones(moon):
    image = PICTURES[1]

    async def main():
        got = await asyncio.gather(
            moon.acaption(image, length="short"), moon.aquery(image, "what is the cat on"),
            moon.apoint(image, "cat"), moon.adetect(image, "dog", settings={"max_objects": 2}),
            moon.aquery(question="what is the cat on"), moon.arun("point", image=image, object="dog"))
        streamed = await moon.aquery(image, "what is the cat on", stream=True)
        text = "".join([piece async for piece in streamed["answer"]])
        encoded = await moon.aencode_image(image)
        return got, text, encoded

    got, text, encoded = asyncio.run(main())
    assert got == [moon.caption(image, length="short"), moon.query(image, "what is the cat on"),
                   moon.point(image, "cat"), moon.detect(image, "dog", settings={"max_objects": 2}),
                   moon.query(question="what is the cat on"), moon.point(image, "dog")]
    assert text.strip() == got[1]["answer"]
    assert moon.point(encoded, "cat") == got[2]


def test_a_cancelled_task_and_a_dropped_stream_cancel_their_image_requests():
    gate = Gate()
    engine = moon_engine(gate=gate, eos_every=10**9)
    try:
        async def cancelled_task():
            gate.arm(at=2)
            task = asyncio.ensure_future(engine.aquery(PICTURES[0], "is the sky blue", max_tokens=40))
            await asyncio.to_thread(gate.wait_reached)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancelled_task())
        gate.open()
        wait_idle(engine)

        async def dropped_stream():
            gate.arm(at=2)
            streamed = await engine.aquery(PICTURES[0], "is the sky blue", stream=True, max_tokens=40)
            handle = streamed["answer"].handle
            await asyncio.to_thread(gate.wait_reached)
            del streamed
            gc.collect()
            gate.open()
            return handle

        handle = asyncio.run(dropped_stream())
        assert handle.result(WAIT).status is Status.CANCELLED
        gate.arm(at=2)
        pieces = engine.query(PICTURES[0], "is the sky blue", stream=True, max_tokens=40)["answer"]
        gate.wait_reached()
        pieces.close()
        gate.open()
        assert pieces.handle.result(WAIT).status is Status.CANCELLED
        with pytest.raises(RequestFailed):
            list(pieces)
        wait_idle(engine)
    finally:
        gate.open()
        engine.close()


# -- bad values ------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_image_is_refused_naming_image_and_the_engine_keeps_serving(moon, tmp_path, kind):
    bad = BAD[kind](tmp_path)
    calls = [lambda: moon.point(bad, "cat"), lambda: moon.caption(bad, length="short"),
             lambda: moon.submit("detect", image=bad, object="x"), lambda: asyncio.run(moon.adetect(bad, "cat"))]
    if bad is not None:  # a query without an image is a text-only query
        calls.append(lambda: moon.query(bad, "what is this"))
    for call in calls:
        with pytest.raises(InvalidRequest, match=r"^image: "):
            call()
    assert moon.point(PICTURES[0], "cat") == expected(moon, "point", image=PICTURES[0], object="cat")[1]


def _other_engines_image():
    other = moon_engine()
    try:
        return other.encode_image(PICTURES[0])
    finally:
        other.close()


BAD_CALLS = {
    "stream not a bool": (lambda e: e.query(PICTURES[0], "what", stream="yes"), "stream"),
    "settings not a mapping": (lambda e: e.point(PICTURES[0], "cat", settings=[("max_objects", 2)]),
                               "settings"),
    "unknown setting": (lambda e: e.detect(PICTURES[0], "cat", settings={"max_boxes": 2}), "settings.max_boxes"),
    "max_objects for a caption": (lambda e: e.caption(PICTURES[0], settings={"max_objects": 2}),
                                  "settings.max_objects"),
    "negative temperature": (lambda e: e.query(PICTURES[0], "what", settings={"temperature": -1.0}),
                             "settings.temperature"),
    "nan top_p": (lambda e: e.caption(PICTURES[0], settings={"top_p": float("nan")}), "settings.top_p"),
    "string seed": (lambda e: e.caption(PICTURES[0], settings={"seed": "7"}), "settings.seed"),
    "negative top_k": (lambda e: e.point(PICTURES[0], "cat", settings={"top_k": -1}), "settings.top_k"),
    "min_p over 1": (lambda e: e.query(PICTURES[0], "what", settings={"min_p": 2}), "settings.min_p"),
    "zero max_tokens": (lambda e: e.query(PICTURES[0], "what", settings={"max_tokens": 0}), "max_tokens"),
    "max_tokens twice": (lambda e: e.query(PICTURES[0], "what", settings={"max_tokens": 3}, max_tokens=3),
                         "settings.max_tokens"),
    "sampling twice": (lambda e: e.query(PICTURES[0], "what", settings={"top_p": 0.5},
                                         sampling=SamplingParams()), "settings"),
    "zero max_objects": (lambda e: e.point(PICTURES[0], "cat", settings={"max_objects": 0}), "max_objects"),
    "bool max_objects": (lambda e: e.detect(PICTURES[0], "cat", settings={"max_objects": True}), "max_objects"),
    "empty object": (lambda e: e.point(PICTURES[0], "  "), "object"),
    "object not text": (lambda e: e.detect(PICTURES[0], 7), "object"),
    "no object": (lambda e: e.detect(PICTURES[0]), "object"),
    "no question": (lambda e: e.query(PICTURES[0]), "question"),
    "bad length": (lambda e: e.caption(PICTURES[0], length="huge"), "length"),
    "caption without image": (lambda e: e.caption(length="short"), "image"),
    "point without image": (lambda e: e.point("cat"), "image"),
    "segment on a region head": (lambda e: e.segment(PICTURES[0], "cat"), "skill"),
    "unknown skill, image not read": (lambda e: e.run("count", image="/no/such/file.png", object="cat"),
                                      "skill"),
    "unknown argument": (lambda e: e.point(PICTURES[0], "cat", colour="red"), "colour"),
    "image ref of no length": (lambda e: e.submit("query", image=ImageRef(length=0, source=1),
                                                  question="what"), "image"),
    "another engine's encoded image": (lambda e: e.point(_other_engines_image(), "cat"), "image"),
    # A ref the engine did not make reached the backend, whose refusal there
    # was a lost device's: every live request failed and the engine stopped.
    "a hand-made image ref": (lambda e: e.submit("query", image=ImageRef(length=3, source=object()),
                                                 question="what"), "image"),
    "another engine's image ref": (lambda e: e.submit("query", image=_other_engines_image().ref,
                                                      question="what"), "image"),
    "another engine's image ref, async": (lambda e: asyncio.run(e.aquery(_other_engines_image().ref, "what")),
                                          "image"),
    # A list is unhashable: with an image, a bare TypeError.
    "a skill name of a list, with an image": (lambda e: e.submit(["query"], image=PICTURES[0]), "skill"),
    "a skill name of a list, with an image, in a batch": (
        lambda e: e.submit_many([("query", {"question": "a"}), (["query"], {"image": PICTURES[0]})]),
        "calls[1].skill"),
    "max_tokens past the context": (lambda e: e.query(PICTURES[0], "what", max_tokens=10_000), "max_tokens"),
    "listener not callable": (lambda e: e.query(PICTURES[0], "what", listener=3), "listener"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_a_bad_value_is_refused_naming_its_field_and_the_engine_keeps_serving(moon, case):
    call, field = BAD_CALLS[case]
    with pytest.raises(InvalidRequest) as err:
        call(moon)
    assert str(err.value).startswith(f"{field}:"), err.value
    assert moon.point(PICTURES[0], "cat") == expected(moon, "point", image=PICTURES[0], object="cat")[1]


def test_an_image_over_the_engines_pixel_limit_is_refused():
    engine = moon_engine(max_image_pixels=40 * 30 - 1)
    try:
        with pytest.raises(InvalidRequest, match=r"^image: 40x30 is 1200 pixels, over the limit of 1199"):
            engine.point(PICTURES[0], "cat")
        assert engine.point(picture(0, 20, 20), "cat")["points"] is not None
    finally:
        engine.close()


def test_a_text_model_refuses_images_and_keeps_its_calls():
    engine = loc_engine(images=False, values=False)
    try:
        assert not engine.takes_images
        for call in (lambda: engine.query(PICTURES[0], "what"), lambda: engine.point(PICTURES[0], "cat"),
                     lambda: engine.caption(PICTURES[0]), lambda: engine.encode_image(PICTURES[0]),
                     lambda: engine.submit("detect", image=b"not even an image", object="cat")):
            with pytest.raises(InvalidRequest, match=r"^image: this model takes no images"):
                call()
        assert engine.query("what is the cat on", max_tokens=5) == expected(
            engine, "query", question="what is the cat on", max_tokens=5)[1]
        assert engine.caption("short", max_tokens=5)["caption"] == expected(
            engine, "caption", length="short", max_tokens=5)[1]["caption"]
        with pytest.raises(InvalidRequest, match=r"^length: "):
            engine.caption("huge")
        assert engine.point(object="cat", max_tokens=6) == engine.point("cat", max_tokens=6)
        assert engine.detect("cat", max_objects=2) == expected(engine, "detect", object="cat", max_objects=2)[1]
    finally:
        engine.close()


# ----------------------------------------------------------- spatial_refs
REFS = [[0.25, 0.5], [0.1, 0.2, 0.3, 0.6]]


def test_spatial_refs_are_read_as_values_at_their_placeholders(moon):
    """A point is two coordinates, a box its centre's two and its size, after
    the query prefix; the forward reads the values there, so the answer is
    the fake model's with those values, and differs from the plain one."""
    img = picture(7)
    want_tokens, want = expected(moon, "query", image=img, question="what is here", spatial_refs=REFS)
    plain_tokens, _ = expected(moon, "query", image=img, question="what is here")
    assert want_tokens != plain_tokens
    request = moon._request("query", SamplingParams.of(None), dict(image=img, question="what is here",
                                                                  spatial_refs=REFS))
    prefix = len(MOON_TOK.templates.query[0])
    coord, size = MOON_TOK.templates.coord_id, MOON_TOK.templates.size_id
    assert request.prompt[prefix:prefix + 5] == (coord, coord, coord, coord, size)
    assert [(v.index, v.kind.value, v.value) for v in request.prompt_values] == [
        (prefix, "coord", 0.25), (prefix + 1, "coord", 0.5), (prefix + 2, "coord", (0.1 + 0.3) / 2),
        (prefix + 3, "coord", (0.2 + 0.6) / 2), (prefix + 4, "size", (0.3 - 0.1, 0.6 - 0.2))]
    for call in (lambda: moon.query(img, "what is here", spatial_refs=REFS),
                 lambda: asyncio.run(moon.aquery(img, "what is here", spatial_refs=REFS))):
        assert call() == want


def test_numpy_numbers_and_fractions_are_taken_as_refs_and_counts_as_plain_ones(moon):
    """``max_tokens`` and the sampling numbers took numpy's numbers, but
    ``max_objects`` and ``spatial_refs`` refused them, saying a 2 was not an
    integer and a 0.5 not a number in [0, 1]."""
    img = picture(7)
    refs = [[np.float32(0.25), fractions.Fraction(1, 2)], [np.float64(0.1), 0.2, np.float32(0.3), 0.6]]
    assert moon.query(img, "what is here", spatial_refs=refs) == moon.query(img, "what is here",
                                                                            spatial_refs=REFS)
    assert moon.point(img, "cat", max_objects=np.int64(2)) == moon.point(img, "cat", max_objects=2)
    with pytest.raises(InvalidRequest, match=r"^max_objects: must be an integer, got np.True_"):
        moon.point(img, "cat", max_objects=np.bool_(True))


@pytest.mark.parametrize("refs, field, message", [
    ("0.5,0.5", "spatial_refs", "must be a list of"),
    ({"x": 0.5}, "spatial_refs", "must be a list of"),
    ([[0.5]], r"spatial_refs\[0\]", "must be .x, y. or"),
    ([[0.5, 0.5, 0.5]], r"spatial_refs\[0\]", "must be .x, y. or"),
    ([0.5, 0.5], r"spatial_refs\[0\]", "must be .x, y. or"),
    ([[0.5, 0.5], "ab"], r"spatial_refs\[1\]", "must be .x, y. or"),
    ([[0.5, 1.5]], r"spatial_refs\[0\]", "coordinates must be numbers in"),
    ([[0.5, -0.1]], r"spatial_refs\[0\]", "coordinates must be numbers in"),
    ([[0.5, float("nan")]], r"spatial_refs\[0\]", "coordinates must be numbers in"),
    ([[True, 0.5]], r"spatial_refs\[0\]", "coordinates must be numbers in"),
    ([["0.5", 0.5]], r"spatial_refs\[0\]", "coordinates must be numbers in"),
    ([[0.6, 0.1, 0.2, 0.5]], r"spatial_refs\[0\]", "a box needs x_min < x_max"),
    ([[0.1, 0.5, 0.2, 0.5]], r"spatial_refs\[0\]", "a box needs x_min < x_max and y_min < y_max"),
])
def test_bad_spatial_refs_are_refused_naming_the_reference_and_the_engine_keeps_serving(moon, refs, field, message):
    img = picture(8)
    with pytest.raises(InvalidRequest, match=f"^{field}: {message}"):
        moon.query(img, "what is here", spatial_refs=refs)
    assert moon.query(img, "what is here", spatial_refs=[[0.0, 1.0]])["answer"] is not None


def test_spatial_refs_need_an_image_and_a_model_with_placeholders(moon, loc):
    with pytest.raises(InvalidRequest, match="^spatial_refs: refer to an image: give one"):
        moon.query(question="what is here", spatial_refs=REFS)
    with pytest.raises(InvalidRequest, match="^spatial_refs: this model takes none"):
        loc.query(picture(9), "what is here", spatial_refs=REFS)
    assert moon.query(question="what is here")["answer"] is not None
