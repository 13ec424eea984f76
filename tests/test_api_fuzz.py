"""Any Python value in any argument of the Python API: the engine answers,
or refuses naming the argument, and serves on.

Each example calls one of moondream's calls (``caption``, ``query``,
``point``, ``detect``, ``segment``), ``run``, ``submit`` or ``stream``, or
one of their asyncio forms (each in an event loop of its own), on a
moondream2-shaped engine and on a text one, with one to three arguments (the image, the text,
a keyword, a setting) replaced by a value of any kind: None, booleans,
integers past 64 bits, floats with NaN and infinities, text with lone
surrogates, bytes, containers, numpy arrays, images of odd shapes, objects
whose ``repr``, ``==``, ``hash`` or truth raise. Whatever arrives, the
call returns the skill's answer or raises ``InvalidRequest`` whose message
starts with what was wrong (a field, a setting, ``image``); nothing else
escapes, and a valid call after it is answered.
"""

from __future__ import annotations

import asyncio
import datetime
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from bubblefree import InvalidRequest
from tests.image_world import moon_engine, picture
from tests.server_support import fake_engine

IMAGE = picture(5, 64, 48)
CALLS = ("caption", "query", "point", "detect", "segment", "run", "submit", "stream",
         "acaption", "aquery", "apoint", "adetect", "asegment", "arun", "astream")
# The calls named after a skill, blocking or asyncio: the call is the skill.
NAMED = {"caption", "query", "point", "detect", "segment"}
SKILLS = ("caption", "query", "point", "detect", "segment", "complete")
TEXT = {"caption": "length", "query": "question", "point": "object", "detect": "object",
        "segment": "object", "complete": "prompt"}
KEYWORDS = ("max_tokens", "max_objects", "stream", "spatial_refs", "sampling", "settings", "length",
            "question", "object", "image", "listener", "colour")
SETTINGS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_objects", "hue")


class Hostile:
    """An object whose ``what`` raises: ``repr``, ``eq``, ``hash`` or ``bool``."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        if self.what == "repr":
            raise RuntimeError("repr raised")
        return f"Hostile({self.what})"

    def __eq__(self, other: object) -> bool:
        if self.what == "eq":
            raise RuntimeError("eq raised")
        return self is other

    def __hash__(self) -> int:
        if self.what == "hash":
            raise RuntimeError("hash raised")
        return id(self)

    def __bool__(self) -> bool:
        if self.what == "bool":
            raise RuntimeError("bool raised")
        return True


scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.sampled_from([0, 1, -1, 2**31, 2**64, 10**400])
           | st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300])
           | st.text(max_size=12) | st.sampled_from(["", "short", "normal", "long", "\ud800", "cat"])
           | st.binary(max_size=8))
odd = st.builds(Hostile, st.sampled_from(["repr", "eq", "hash", "bool"])) | st.sampled_from([
    object(), print, int,
    np.zeros((2, 2, 3), dtype=np.uint8), np.zeros((0, 4, 3), dtype=np.uint8), np.float32("nan"),
    np.int64(7), np.array([0.5, 0.5]), Image.new("RGB", (1, 1)), Image.new("L", (3, 2)),
    Image.new("RGBA", (4, 4)), IMAGE.copy(), {"temperature": 0.5}, {"x": 0.5, "y": 0.5},
    [[0.1, 0.2], [0.3, 0.4, 0.5, 0.6]], [0.1, 0.2], (0.1, 0.2, 0.3, 0.4), {1, 2}, frozenset(),
    np.array(["short"]), np.array(["cat", "dog"]), np.str_("cat"), np.str_("short"), np.bool_(True),
    np.float64(0.5), np.array(0.5), bytearray(b"cat"), memoryview(b"cat"), 1 + 2j,
    Decimal("0.5"), Fraction(1, 3), datetime.date(2026, 1, 1)])
values = st.recursive(scalars | odd, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(SETTINGS), inner, max_size=2), max_leaves=6)


@st.composite
def calls(draw) -> tuple[str, str, list, dict]:
    """(call, skill, positional arguments, keyword arguments): a valid call
    with one to three arguments replaced by any value, or removed."""
    call = draw(st.sampled_from(CALLS))
    named = call.removeprefix("a") if call.removeprefix("a") in NAMED else None
    skill = named or draw(st.sampled_from(SKILLS if "stream" not in call
                                          else ("caption", "query", "complete")))
    text = {"caption": "short", "query": "what is it", "complete": "the cat"}.get(skill, "cat")
    kwargs: dict = {TEXT[skill]: text, "image": IMAGE, "settings": {"max_tokens": 4}}
    if skill in ("point", "detect"):
        kwargs["settings"]["max_objects"] = 2
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["keyword", "keyword", "setting", "remove"]))
        if where == "setting" and isinstance(kwargs.get("settings"), dict):
            kwargs["settings"][draw(st.sampled_from(SETTINGS))] = draw(values)
        elif where == "remove" and kwargs:
            kwargs.pop(draw(st.sampled_from(sorted(kwargs))))
        else:
            kwargs[draw(st.sampled_from(KEYWORDS + (TEXT[skill],)))] = draw(values)
    if not named:
        if isinstance(kwargs.get("settings"), dict):  # the engine's keywords, not moondream's settings
            kwargs.update({k: v for k, v in kwargs.pop("settings").items()
                           if k in ("max_tokens", "max_objects")})
        return call, skill, [draw(st.sampled_from([skill, skill, skill]) | values)], kwargs
    return call, skill, [], kwargs


@pytest.fixture(scope="module", params=["moondream2", "text"])
def engine(request):
    """A moondream2-shaped engine (images, a region head), or a text one (no
    images: point, detect and segment refused, ``complete`` served)."""
    eng = moon_engine() if request.param == "moondream2" else fake_engine()
    yield eng
    eng.close()


def answered(out: object, skill: str) -> None:
    key = {"caption": "caption", "query": "answer", "point": "points", "detect": "objects",
           "segment": "path", "complete": "text"}[skill]
    assert isinstance(out, dict) and key in out, out


def serves_on(engine) -> None:
    if engine.takes_images:
        assert "points" in engine.point(IMAGE, "cat", settings={"max_objects": 1})
    else:
        assert isinstance(engine.query("what is it", settings={"max_tokens": 4})["answer"], str)


async def _collect(pieces) -> list:
    return [piece async for piece in pieces]


def _called(engine, call: str, args: list, kwargs: dict) -> object:
    """The call's outcome, whole: a blocking one's return, an asyncio one's
    awaited in a loop of its own, stream pieces read to the end."""
    fn = getattr(engine, call)
    if call == "astream":
        return asyncio.run(_collect(fn(*args, **kwargs)))
    if call.startswith("a"):
        async def whole():
            out = await fn(*args, **kwargs)
            if isinstance(out, dict) and kwargs.get("stream") is True:
                return {k: await _collect(v) for k, v in out.items()}
            return out
        return asyncio.run(whole())
    out = fn(*args, **kwargs)
    if call == "stream":
        return list(out)
    if isinstance(out, dict) and kwargs.get("stream") is True:
        return {k: list(v) for k, v in out.items()}
    return out


@settings(max_examples=200)
@given(case=calls())
def test_any_value_in_any_argument_is_answered_or_refused_naming_it(engine, case):
    call, skill, args, kwargs = case
    try:
        out = _called(engine, call, args, kwargs)
        if call == "submit":
            result = out.result(30)
            assert result.status.name == "COMPLETED", result  # accepted: it must complete
        elif "stream" in call:
            assert all(isinstance(piece, str) for piece in out), out
        elif kwargs.get("stream") is True and skill in ("caption", "query"):
            assert all(isinstance(p, str) for pieces in out.values() for p in pieces), out
        elif not args or args[0] == skill:
            answered(out, skill)
    except InvalidRequest as err:
        message = str(err)
        assert message and ":" in message.split("\n")[0], message
        head = message.split(":")[0]
        assert head and " " not in head.strip(), message  # a name, not a sentence
    serves_on(engine)
