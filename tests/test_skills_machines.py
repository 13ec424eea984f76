"""Skill state machines under adversarial token choices (no engine).

Hypothesis picks every committed token among those the state allows, so each
property holds for any model: outputs always parse into their result shape,
every token was allowed (I9, checked by ``drive``), budgets and cancels leave
only whole objects, and an illegal token raises without changing the state.
"""

from __future__ import annotations

import copy
import re

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from bubblefree.core import InvalidRequest, ValueKind
from bubblefree.skills import Kind, RegionHeadCodec, SkillError, SkillSet, demo_tokenizer
from bubblefree.skills.driver import MaskRecorder, drive

TOK = demo_tokenizer()
EOS = TOK.eos_id
MASKS = MaskRecorder()
SKILLS = SkillSet(TOK, MASKS.register).compile_all()
CODEC = SKILLS.codec
EDGES = frozenset({CODEC.encode(Kind.X, 0.0), CODEC.encode(Kind.X, 1.0),
                   CODEC.encode(Kind.SIZE, 0.0), CODEC.encode(Kind.SIZE, 1.0)})
SLOTS = {"point": 2, "detect": 4}
ARGS = {"query": {"question": "what is this"}, "caption": {"length": "short"},
        "point": {"object": "cat"}, "detect": {"object": "dog"},
        "segment": {"object": "cat"}, "yesno": {"question": "is there a cat"}}
_sorted: dict[frozenset[int], list[int]] = {}


def adversary(data, values=None):
    """A pick that lets Hypothesis choose any allowed token, biased toward
    EOS and the extreme bins so short outputs and edge values are common."""
    def pick(allowed, step):
        choices = _sorted.setdefault(allowed, sorted(range(len(TOK)) if allowed is None else allowed))
        mode = data.draw(st.integers(0, 5), label="mode")
        edges = [t for t in choices if t in EDGES]
        if mode == 0 and (allowed is None or EOS in allowed):
            token = EOS
        elif mode == 1 and edges:
            token = data.draw(st.sampled_from(edges), label="edge")
        else:
            token = data.draw(st.sampled_from(choices), label="token")
        value = None if values is None else data.draw(values, label="value")
        return token, value
    return pick


def unit(v):
    return isinstance(v, float) and 0.0 <= v <= 1.0


def check_box(b):
    assert set(b) == {"x_min", "y_min", "x_max", "y_max"}
    assert all(unit(v) for v in b.values())
    assert b["x_min"] <= b["x_max"] and b["y_min"] <= b["y_max"]


PATH_TOKEN = re.compile(r"[MLCZ]|\d+(?:\.\d+)?")
ARITY = {"M": 2, "L": 2, "C": 6, "Z": 0}


def parse_path(d):
    """A strict parser for the path subset segment emits: (letter, numbers)."""
    parts = d.split()
    assert " ".join(PATH_TOKEN.fullmatch(p).group() for p in parts) == d
    commands, i = [], 0
    while i < len(parts):
        letter = parts[i]
        n = ARITY[letter]
        nums = [float(x) for x in parts[i + 1:i + 1 + n]]
        assert len(nums) == n and not any(p in ARITY for p in parts[i + 1:i + 1 + n])
        commands.append((letter, nums))
        i += 1 + n
    if commands:
        assert commands[0][0] == "M"
    for prev, cur in zip(commands, commands[1:]):
        if prev[0] == "Z":
            assert cur[0] == "M"
    return commands


def check_output(name, out, args):
    if name in ("query", "caption"):
        assert set(out) == {"answer" if name == "query" else "caption"}
        assert isinstance(next(iter(out.values())), str)
    elif name == "yesno":
        assert out["answer"] in (True, False, None)
    elif name == "point":
        assert len(out["points"]) <= args.get("max_objects", 50)
        for p in out["points"]:
            assert set(p) == {"x", "y"} and unit(p["x"]) and unit(p["y"])
    elif name == "detect":
        assert len(out["objects"]) <= args.get("max_objects", 50)
        for b in out["objects"]:
            check_box(b)
    elif name == "segment":
        assert set(out) == {"path", "bbox"}
        if out["bbox"] is None:
            assert out["path"] == ""
            return
        check_box(out["bbox"])
        b = out["bbox"]
        for letter, nums in parse_path(out["path"]):
            xs, ys = nums[0::2], nums[1::2]
            assert all(b["x_min"] <= x <= b["x_max"] for x in xs)
            assert all(b["y_min"] <= y <= b["y_max"] for y in ys)


def objects(out):
    for key in ("points", "objects"):
        if key in out:
            return out[key]
    return None


@st.composite
def calls(draw, names=tuple(ARGS)):
    name = draw(st.sampled_from(names))
    args = dict(ARGS[name])
    if name in SLOTS:
        args["max_objects"] = draw(st.integers(1, 6))
    max_tokens = draw(st.integers(1, 60))
    return name, args, max_tokens


@settings(deadline=None)
@given(calls(), st.data())
def test_any_allowed_tokens_give_a_well_formed_result(call, data):
    name, args, max_tokens = call
    req = SKILLS.request(name, max_tokens=max_tokens, **args)
    tokens, out = drive(req, MASKS, adversary(data))  # raises on an I9 break
    assert len(tokens) <= max_tokens
    check_output(name, out, args)
    # The finisher rebuilds the same result from tokens alone (an engine that
    # ends a request before building, or before advancing on, its state).
    assert req.finisher(tokens, None) == out
    found = objects(out)
    if found is not None:
        # Budgets never cut an object: every token belongs to a whole object,
        # but a final EOS.
        eos = 1 if tokens and tokens[-1] == EOS else 0
        assert len(tokens) == SLOTS[name] * len(found) + eos
        assert len(found) <= args["max_objects"]


@settings(deadline=None)
@given(calls(), st.data())
def test_a_cancel_keeps_whole_objects_only(call, data):
    name, args, max_tokens = call
    req = SKILLS.request(name, max_tokens=max_tokens, **args)
    tokens, out = drive(req, MASKS, adversary(data))
    cut = data.draw(st.integers(0, len(tokens)), label="cut")
    early = req.finisher(tokens[:cut], None)
    check_output(name, early, args)
    found = objects(out)
    if found is not None:
        k = SLOTS[name]
        assert objects(early) == found[:cut // k]
    elif name == "segment" and out["bbox"] is not None and early["bbox"] is not None:
        assert early["bbox"] == out["bbox"]
        full = parse_path(out["path"])
        assert parse_path(early["path"]) == full[:len(parse_path(early["path"]))]


def snapshot(state):
    return copy.deepcopy({k: v for k, v in attrs.asdict(state, recurse=False).items()
                          if k != "tables"})


@settings(deadline=None)
@given(calls(), st.data())
def test_an_illegal_token_raises_and_changes_nothing(call, data):
    name, args, max_tokens = call
    req = SKILLS.request(name, max_tokens=max_tokens, **args)
    state = req.decode_state()
    steps = data.draw(st.integers(0, max_tokens - 1), label="steps")
    pick = adversary(data)
    for i in range(steps):
        token, value = pick(MASKS.allowed(state.mask_id()), i)
        if state.advance(token, value):
            with pytest.raises(SkillError):
                state.advance(token, value)  # nothing after the end (I5)
            return
    mask = state.mask_id()
    outside = sorted(set(range(len(TOK))) - MASKS.allowed(mask))
    if not outside:
        return
    before = snapshot(state)
    with pytest.raises(SkillError):
        state.advance(data.draw(st.sampled_from(outside), label="illegal"), None)
    assert snapshot(state) == before and state.mask_id() == mask


def test_masks_are_registered_once_each():
    assert len(set(MASKS.masks)) == len(MASKS.masks)
    before = len(MASKS.masks)
    for name, args in ARGS.items():
        req = SKILLS.request(name, **args)
        state = req.decode_state()
        state.mask_id()
    assert len(MASKS.masks) == before  # requests and states register nothing
    text = MASKS.allowed(SKILLS.tables("query").mask)
    assert not text & CODEC.spatial_ids() and EOS in text  # text never samples a location


def test_budget_too_small_for_an_object_allows_only_eos():
    for name, budget in (("point", 1), ("detect", 3), ("segment", 6)):
        state = SKILLS.request(name, object="cat", max_tokens=budget).decode_state()
        assert MASKS.allowed(state.mask_id()) == {EOS}
    state = SKILLS.request("detect", object="cat", max_tokens=6).decode_state()
    for t in (CODEC.encode(Kind.X, .5), CODEC.encode(Kind.Y, .5),
              CODEC.encode(Kind.SIZE, .1), CODEC.encode(Kind.SIZE, .1)):
        done = state.advance(t)
    assert done  # one box fits in 6 tokens, a second does not: ended, no EOS needed


def test_max_objects_ends_the_list():
    req = SKILLS.request("point", object="cat", max_objects=2)
    x = CODEC.encode(Kind.X, 0.25)
    tokens, out = drive(req, MASKS, lambda allowed, step: (x, None))
    assert len(tokens) == 4 and out == {"points": [{"x": 0.25048828125, "y": 0.25048828125}] * 2}


REGION = RegionHeadCodec.for_tokenizer(TOK)
REGION_MASKS = MaskRecorder()
REGION_SKILLS = SkillSet(TOK, REGION_MASKS.register, codec=REGION)
REGION_SLOTS = {"point": 2, "detect": 3}  # a region head's size is one (width, height) step
CAT = TOK.encode("cat")[0]


def region_values(data, seen):
    """Values as a region head decodes them, any float (clamped by the codec),
    a pair at a size step; each is recorded in ``seen``."""
    v = st.floats(-0.5, 1.5, allow_nan=False)

    def value(kind, step):
        got = (data.draw(v), data.draw(v)) if kind is ValueKind.SIZE else data.draw(v)
        seen.append((kind, got))
        return got
    return value


def clamp(v):
    return min(1.0, max(0.0, v))


@settings(deadline=None)
@given(st.sampled_from(["point", "detect"]), st.integers(1, 5), st.integers(1, 40), st.data())
def test_a_region_head_codec_plugs_in_without_touching_skills(name, max_objects, max_tokens, data):
    req = REGION_SKILLS.request(name, object="cat", max_objects=max_objects, max_tokens=max_tokens)
    seen = []
    tokens, out = drive(req, REGION_MASKS, adversary(data), values=region_values(data, seen))
    check_output(name, out, {"max_objects": max_objects})
    found = objects(out)
    eos = 1 if tokens and tokens[-1] == EOS else 0
    # Every step but a final EOS belongs to a whole object, and every step
    # that could carry an object asked for its value.
    assert len(tokens) == REGION_SLOTS[name] * len(found) + eos
    assert EOS not in tokens[:len(tokens) - eos]
    kinds = [k for k, _ in seen]
    cycle = [ValueKind.COORD, ValueKind.COORD] + ([ValueKind.SIZE] if name == "detect" else [])
    assert kinds[:len(cycle) * len(found)] == cycle * len(found)
    flat = [x for _, v in seen[:len(cycle) * len(found)] for x in (v if isinstance(v, tuple) else (v,))]
    if name == "point":  # the values, clamped to [0, 1], are the coordinates
        assert [c for p in found for c in (p["x"], p["y"])] == [clamp(x) for x in flat]
    else:
        for box, (cx, cy, w, h) in zip(found, zip(*[iter(map(clamp, flat))] * 4)):
            assert box == {"x_min": clamp(cx - w / 2), "y_min": clamp(cy - h / 2),
                           "x_max": clamp(cx + w / 2), "y_max": clamp(cy + h / 2)}


def test_region_head_values_are_the_coordinates():
    req = REGION_SKILLS.request("detect", object="cat", max_objects=1)
    vals = iter([0.5, 0.5, (0.2, 0.4)])
    _, out = drive(req, REGION_MASKS, lambda allowed, step: (CAT, None),
                   values=lambda kind, step: next(vals))
    box = out["objects"][0]
    assert [round(box[k], 9) for k in ("x_min", "y_min", "x_max", "y_max")] == [0.4, 0.3, 0.6, 0.7]
    state = req.decode_state()
    for bad in (None, float("nan"), (0.5, 0.5), "0.5"):  # x without its value, or not a number
        with pytest.raises(ValueError):
            state.advance(CAT, bad)
        assert state.consumed == 0 and not state.partial
    state.advance(CAT, 0.5)
    state.advance(CAT, 0.5)
    for bad in (None, 0.5, (0.5,), (0.5, float("inf")), [0.2, 0.4]):  # a size is a pair
        with pytest.raises(ValueError):
            state.advance(CAT, bad)
        assert state.consumed == 2 and state.partial == [0.5, 0.5]


def test_region_head_masks_follow_moondream():
    """x: the whole vocabulary (EOS ends the list, anything else is "x
    follows"); y and size: anything but EOS, never an end; values asked
    at x, y (coordinates) and the size (a pair)."""
    every_but_eos = frozenset(range(len(TOK))) - {EOS}
    state = REGION_SKILLS.request("detect", object="cat", max_objects=2).decode_state()
    seen = []
    for value in (0.1, 0.2, (0.3, 0.4), 0.5, 0.6, (0.7, 0.8)):
        seen.append((REGION_MASKS.allowed(state.mask_id()), state.value_kind()))
        state.advance(TOK.encode("the")[0], value)
    assert seen == [(None, ValueKind.COORD), (every_but_eos, ValueKind.COORD),
                    (every_but_eos, ValueKind.SIZE)] * 2
    assert state.done and state.value_kind() is None
    state = REGION_SKILLS.request("point", object="cat").decode_state()
    assert state.advance(EOS, 0.3) and state.objects == []  # EOS at x: the end, its value unread
    state = REGION_SKILLS.request("point", object="cat").decode_state()
    state.advance(CAT, 0.3)
    with pytest.raises(SkillError):  # EOS at y: refused, unchanged
        state.advance(EOS, 0.3)
    assert state.partial == [0.3]
    # A budget too small for a whole object: EOS only, and no value asked.
    for name, budget in (("point", 1), ("detect", 2)):
        state = REGION_SKILLS.request(name, object="cat", max_tokens=budget).decode_state()
        assert REGION_MASKS.allowed(state.mask_id()) == {EOS} and state.value_kind() is None
    text = REGION_MASKS.allowed(REGION_SKILLS.tables("query").mask)
    assert text == frozenset(range(len(TOK)))  # no token is reserved for values


def test_segment_is_refused_on_a_region_head():
    with pytest.raises(InvalidRequest, match=r"^skill: a model with a region head \(moondream2\) has "
                                             r"no segment skill"):
        REGION_SKILLS.request("segment", object="cat")
    assert not REGION_SKILLS.serves("segment") and REGION_SKILLS.serves("detect")
    assert "segment" not in REGION_SKILLS.compile_all()._tables
