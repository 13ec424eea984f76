"""The Python API against what callers do by accident: listeners that raise
BaseExceptions, the asyncio forms' order of checks, a stream cut inside a
character, image objects at the edges of what is read, an engine only a
live request refers to, the image limit through the builders, malformed
``submit_many`` calls, and calls after ``close``."""

from __future__ import annotations

import asyncio
import gc
import re

import numpy as np
import pytest
from PIL import Image

from bubblefree import Engine, EngineStopped, InvalidRequest
from bubblefree.core import Status
from bubblefree.images import pillow_max_pixels
from bubblefree.skills import RegionHeadCodec
from tests.image_world import MOON_TOK, _engine, moon_engine, picture
from tests.serving_world import WAIT, Ends, Gate, assert_serves, make_engine, wait_idle


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def moon():
    eng = moon_engine()
    yield eng
    eng.close()


def _three(engine, bad):
    ends = Ends()
    handles = engine.submit_many([
        ("query", dict(question="the cat", max_tokens=20, listener=ends.listener(bad))),
        ("query", dict(question="a dog", max_tokens=12, listener=ends.listener())),
        ("query", dict(question="red car", max_tokens=9, listener=ends.listener()))])
    ends.wait_all(handles)
    return [h.result(0) for h in handles]


def test_a_listener_raising_cancelled_error_fails_only_its_own_request(engine):
    """asyncio's CancelledError is a BaseException: a listener touching a
    cancelled future raises it. It fails that request, named; the others
    complete and the engine keeps serving (it stopped the engine before)."""
    def bad(handle, token):
        if token is not None and len(handle.tokens) == 2:
            raise asyncio.CancelledError("a cancelled future")

    first, *others = _three(engine, bad)
    assert first.status is Status.FAILED and "CancelledError" in first.finish_reason
    assert [r.status for r in others] == [Status.COMPLETED, Status.COMPLETED]
    wait_idle(engine)
    assert_serves(engine)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_listener_asking_the_process_to_stop_stops_the_engine_naming_it(engine, exc):
    """KeyboardInterrupt and SystemExit are not a request's failure: the
    engine stops, and every request ends, failed with the error named."""
    def bad(handle, token):
        if token is not None and len(handle.tokens) == 2:
            raise exc()

    results = _three(engine, bad)
    assert all(r.status is Status.FAILED and exc.__name__ in r.finish_reason for r in results)
    with pytest.raises(EngineStopped, match=exc.__name__):
        engine.submit("query", question="more")


@pytest.mark.parametrize("call", [
    lambda m: m.arun("count", image="/no/such/file.png", object="cat"),
    lambda m: m.asegment("/no/such/file.png", "cat"),  # moondream2 serves no segment
    lambda m: m.astream_now("no such skill", image="/no/such/file.png", question="x"),
])
def test_the_asyncio_forms_refuse_an_unknown_skill_before_reading_the_image(moon, call):
    """As the blocking forms: ``skill: ...``, not ``image: no file``."""
    with pytest.raises(InvalidRequest, match="^skill: "):
        asyncio.run(call(moon))


@pytest.fixture(scope="module")
def smol():
    eng = Engine.from_pretrained(max_rows=4, max_seqs=8, num_pages=256, max_prefill_tokens=256,
                                 max_context=512)
    yield eng
    eng.close()


JAPANESE = "Write the Japanese word for cat in kanji and an emoji of a cat."


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_stream_cut_inside_a_character_ends_with_what_the_blocking_answer_holds(smol, max_tokens):
    """The stream holds back text ending in an incomplete character; at the
    end it gives it, as the blocking answer does (U+FFFD included)."""
    blocking = smol.query(JAPANESE, max_tokens=max_tokens)["answer"]
    assert blocking.endswith("\ufffd"), f"the answer must be cut inside a character: {blocking!r}"
    streamed = "".join(smol.stream_query(JAPANESE, max_tokens=max_tokens))

    async def astreamed():
        return "".join([p async for p in smol.astream(question=JAPANESE, max_tokens=max_tokens)])

    assert (streamed.strip(), asyncio.run(astreamed()).strip()) == (blocking, blocking)


def test_a_premultiplied_grey_image_is_composited_over_white(moon):
    from bubblefree.images import load_image

    image = Image.new("La", (4, 4), (100, 128))  # grey 100 premultiplied by alpha 128
    assert load_image(image).getpixel((0, 0)) == (227,) * 3  # 100 * 255 / 128, half over white
    assert moon.point(image, "cat")["points"] is not None


def test_grey_and_rgb_with_a_transparent_colour_are_composited_over_white():
    from bubblefree.images import load_image

    for mode, key, other in (("L", 7, 9), ("RGB", (1, 2, 3), (4, 5, 6))):
        image = Image.new(mode, (2, 1), other)
        image.putpixel((0, 0), key)
        image.info["transparency"] = key
        rgb = load_image(image)
        assert rgb.getpixel((0, 0)) == (255, 255, 255)
        assert rgb.getpixel((1, 0)) == ((other,) * 3 if mode == "L" else other)


class _Interface:
    """An object that has only ``__array_interface__`` (and ``tobytes`` if asked)."""

    def __init__(self, array, tobytes: bool):
        self._keep = array
        self.__array_interface__ = array.__array_interface__
        if tobytes:
            self.tobytes = array.tobytes


@pytest.mark.parametrize("tobytes", [True, False])
def test_an_hw1_array_without_reshape_is_read_or_refused_naming_image(moon, tobytes):
    from bubblefree.images import load_image

    grey = np.asarray(picture(0))[:, :, :1]  # [H, W, 1], strided
    like = _Interface(grey, tobytes)
    if tobytes:
        assert np.array_equal(np.asarray(load_image(like))[:, :, 0], grey[:, :, 0])
        assert moon.point(like, "cat")["points"] is not None
    else:
        with pytest.raises(InvalidRequest, match="^image: .*neither reshape nor tobytes"):
            moon.point(like, "cat")


@pytest.mark.parametrize("form", ["stream", "handle"])
def test_a_live_request_keeps_its_engine_serving_until_it_ends(form):
    """An engine closes when it is collected; a stream or handle in use is
    not collected, and neither is the engine under it until it ends."""
    if form == "stream":
        pieces = make_engine().stream("query", question="the cat", max_tokens=8)
        gc.collect()
        assert "".join(pieces)
        handle = pieces.handle
    else:
        handle = make_engine().submit("query", question="the cat", max_tokens=8)
        gc.collect()
    assert handle.result(WAIT).status is Status.COMPLETED
    assert handle._engine is None  # ended: it keeps nothing alive


def test_max_image_pixels_can_be_given_to_the_builders():
    eng = Engine.moondream_random("tiny", device="cpu", max_image_pixels=40 * 30 - 1, page_size=16,
                                  num_pages=400, max_rows=4, max_seqs=8, max_prefill_tokens=3200,
                                  min_graph_context=16)
    try:
        with pytest.raises(InvalidRequest, match="^image: 40x30 is 1200 pixels"):
            eng.point(picture(0, 40, 30), "cat")
        assert eng.point(picture(0, 39, 30), "cat")["points"] is not None
    finally:
        eng.close()


@pytest.mark.parametrize("bad", ["1000", (1000,), 0, -5, True, 2.5])
def test_a_bad_max_image_pixels_is_refused_naming_it(bad):
    with pytest.raises(InvalidRequest, match="^max_image_pixels: must be an int >= 1"):
        _engine(MOON_TOK, RegionHeadCodec.for_tokenizer(MOON_TOK), gate=None, pipelined=True,
                eos_every=6, max_image_pixels=bad)
    with pytest.raises(InvalidRequest, match="^max_image_pixels: must be an int >= 1"):
        Engine.moondream_random("tiny", device="cpu", max_image_pixels=bad)


def test_a_max_image_pixels_past_what_pillow_decodes_is_refused_naming_it():
    """Set past Pillow's own limit, max_image_pixels was never honoured:
    an image between the two was refused in Pillow's words, as a bomb."""
    most = pillow_max_pixels()
    assert most is not None  # the images extra is installed for these tests
    with pytest.raises(InvalidRequest, match=f"^max_image_pixels: at most {most}, "):
        Engine.moondream_random("tiny", device="cpu", max_image_pixels=most + 1)
    eng = Engine.moondream_random("tiny", device="cpu", max_image_pixels=most, page_size=16,
                                  num_pages=64)
    eng.close()


@pytest.mark.parametrize("calls", [[("query", None)], ["query"], [("query",)], [("query", "question")],
                                   [("query", {"question": "a"}), 7]])
def test_submit_many_refuses_a_malformed_call_naming_it(engine, calls):
    with pytest.raises(InvalidRequest, match=r"^calls\[\d\]: must be a \(skill, arguments\) pair"):
        engine.submit_many(calls)
    assert_serves(engine)


@pytest.mark.parametrize("bad,field", [
    (dict(question=""), "question"),  # the skill's own check
    (dict(question="a dog", colour="red"), "colour"),
    (dict(question="a dog", max_tokens=10**6), "max_tokens"),
    (dict(question="a dog", sampling={"temperature": -1}), "sampling.temperature"),
    (dict(question="a dog", listener=3), "listener"),
], ids=["empty-question", "unknown-argument", "max-tokens", "sampling", "listener"])
def test_submit_many_names_the_refused_call_and_submits_none(engine, bad, field):
    """A call's own refusal said ``question: must not be empty``: in a batch
    that names no call. It names ``calls[i]`` now, and the batch stays all
    or nothing: the good calls before it were not submitted either."""
    heard = []
    good = dict(question="the cat", max_tokens=4, listener=lambda handle, token: heard.append(handle))
    before = engine.submit("query", question="a dog", max_tokens=2)
    with pytest.raises(InvalidRequest, match=rf"^calls\[2\]\.{re.escape(field)}: "):
        engine.submit_many([("query", good), ("query", good), ("query", bad)])
    after = engine.submit("query", question="a dog", max_tokens=2)
    assert after.request_id == before.request_id + 1, "a refused batch took request ids: it was submitted"
    assert after.result(WAIT).status is Status.COMPLETED
    wait_idle(engine)
    assert heard == []
    assert_serves(engine)


def test_submit_many_names_the_call_the_core_refuses():
    """The core's own checks (a token id past the vocabulary) are named too."""
    eng = make_engine()
    try:
        with pytest.raises(InvalidRequest, match=r"^calls\[1\]\.prompt: token ids must be ints"):
            eng.submit_many([("complete", dict(prompt=[3, 4], max_tokens=2)),
                             ("complete", dict(prompt=[10**6], max_tokens=2))])
        with pytest.raises(InvalidRequest, match=r"^prompt: token ids must be ints"):
            eng.submit("complete", prompt=[10**6], max_tokens=2)  # a lone call has no position to name
        assert_serves(eng)
    finally:
        eng.close()


def test_encode_image_after_close_raises_engine_stopped():
    eng = moon_engine()
    eng.close()
    with pytest.raises(EngineStopped):
        eng.encode_image(picture(0))
    with pytest.raises(EngineStopped):
        asyncio.run(eng.aencode_image(picture(0)))


def test_a_failed_stream_read_again_raises_again():
    """A cut answer never passes for a whole one, on a second read either."""
    from bubblefree import RequestFailed

    gate = Gate()
    eng = make_engine(gate=gate)
    try:
        gate.arm(2)
        pieces = eng.stream("query", question="the sky", max_tokens=50)
        gate.wait_reached()
        assert pieces.handle.cancel()
        gate.open()
        with pytest.raises(RequestFailed):
            list(pieces)
        with pytest.raises(RequestFailed):
            next(pieces)

        async def twice():
            gate.arm(2)
            stream = await eng.astream_now("query", question="a sky", max_tokens=50)
            await asyncio.to_thread(gate.wait_reached)
            assert stream.handle.cancel()
            gate.open()
            for _ in range(2):
                with pytest.raises(RequestFailed):
                    async for _ in stream:
                        pass

        asyncio.run(twice())
        assert_serves(eng)
    finally:
        gate.open()
        eng.close()


def test_an_async_listener_is_refused_naming_it(engine):
    async def listener(handle, token):
        pass

    with pytest.raises(InvalidRequest, match="^listener: must be a plain function"):
        engine.submit("query", question="the cat", listener=listener)
    assert_serves(engine)


@pytest.mark.parametrize("bound", [{"max_context": 48}, {"num_pages": 10}], ids=["context", "kv-pages"])
def test_output_room_is_where_submit_starts_refusing_a_prompt_as_too_long(bound):
    """``Engine.output_room`` is the count ``submit`` refuses by (the server
    names an image that leaves no room by it), whichever bound is the
    nearer: a prompt that leaves one output token is served, one token more
    is refused naming the prompt."""
    engine = make_engine(**bound)
    try:
        longest = next(n for n in range(1, 64) if engine.output_room(n + 1) < 1)
        assert engine.output_room(longest) == 1
        assert engine.submit("complete", prompt=[5] * longest).result(timeout=WAIT).tokens
        with pytest.raises(InvalidRequest, match=r"^prompt: is \d+ tokens"):
            engine.submit("complete", prompt=[5] * (longest + 1))
        assert_serves(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("prompt,says", [
    ([10**5000], "token ids must be ints in [0, {v}), got an integer of 5001 digits"),
    ([1, -(10**400)], "token ids must be ints in [0, {v}), got an integer of 401 digits"),
    ([1, 10**6], "token ids must be ints in [0, {v}), got 1000000"),
    ([10**5000, "x"], "must be text or a non-empty list of token ids, got a list holding a str at [1]"),
    ([], "must be text or a non-empty list of token ids, got an empty list"),
    ((1, True), "must be text or a non-empty list of token ids, got a tuple holding a bool at [1]"),
    (list(range(10**6)) + [None], "must be text or a non-empty list of token ids, got a list holding a "
                                  "NoneType at [1000000]"),
    (7, "must be text or a non-empty list of token ids, got int"),
])
def test_a_completions_prompt_is_refused_by_what_it_holds_never_by_its_repr(engine, prompt, says):
    """A repr of an int past 4,300 digits raises ValueError, which the skill's
    guard turned into a SkillError; a list of a million ids was quoted
    whole before being cut."""
    vocab = len(engine.skills.tokenizer)
    with pytest.raises(InvalidRequest) as err:
        engine.submit("complete", prompt=prompt, max_tokens=2)
    assert str(err.value) == f"prompt: {says.format(v=vocab)} (skill 'complete')"
    assert_serves(engine)


class _Unquotable:
    """A caller's object whose repr and str raise."""

    def __repr__(self):
        raise RuntimeError("no repr")

    __str__ = __repr__

    def __hash__(self):  # a skill's name is looked up
        return 1


@pytest.mark.parametrize("field,call", [
    ("max_tokens", lambda e, x: e.submit("query", question="a", max_tokens=x)),
    ("length", lambda e, x: e.submit("caption", length=x)),
    ("stream", lambda e, x: e.query("a", stream=x)),
    ("sampling.temperature", lambda e, x: e.submit("query", question="a", sampling={"temperature": x})),
    ("sampling.top_k", lambda e, x: e.submit("query", question="a", sampling={"top_k": x})),
    ("sampling.min_p", lambda e, x: e.submit("query", question="a", sampling={"min_p": x})),
    ("sampling.seed", lambda e, x: e.submit("query", question="a", sampling={"seed": x})),
    ("settings.top_p", lambda e, x: e.query("a", settings={"top_p": x})),
    ("skill", lambda e, x: e.run(x)),
    ("skill", lambda e, x: e.submit(x)),
    ("page_size", lambda e, x: Engine.from_pretrained(page_size=x)),
    ("seed", lambda e, x: Engine.moondream_random(seed=x)),
])
def test_a_value_whose_repr_raises_is_refused_naming_its_field_by_its_type(engine, field, call):
    """The refusal quoted the value's repr, and a repr that raised left the
    caller a bare RuntimeError (or a SkillError) in place of the refusal."""
    with pytest.raises(InvalidRequest) as err:
        call(engine, _Unquotable())
    assert str(err.value).startswith(f"{field}: ") and "a _Unquotable (its repr raised)" in str(err.value)
    assert_serves(engine)


def test_a_mode_whose_repr_raises_is_refused_by_its_type(engine):
    with pytest.raises(TypeError, match=r'^pipelined must be True, False or "auto", got a _Unquotable'):
        engine.pipelined = _Unquotable()
    assert_serves(engine)


def test_a_timeout_whose_repr_raises_is_refused_by_its_type(engine):
    handle = engine.submit("query", question="a", max_tokens=2)
    with pytest.raises(ValueError, match=r"^timeout: seconds >= 0 or None, not a _Unquotable \(its repr raised\)$"):
        handle.result(_Unquotable())
    assert handle.result(WAIT).status is Status.COMPLETED


@pytest.mark.parametrize("length", [np.array(["short"]), np.array([1, 2]), np.str_("tall")],
                         ids=["one-element array", "array", "numpy str"])
def test_a_caption_length_of_numpy_values_is_refused_naming_length(moon, length):
    """``length in ("short", ...)`` compared with ``==``, which a numpy
    array answers elementwise: a one-element array was found "in", then
    failed as a key (a SkillError from the prompt), and a longer one raised
    its ambiguous truth in the skill's parse_args."""
    with pytest.raises(InvalidRequest, match=r"^length: must be one of short, normal, long; got "):
        moon.caption(picture(1), length=length)
    assert isinstance(moon.caption(picture(1), length=np.str_("short"))["caption"], str)
