"""The spatial codec: round trips, boxes from x, y, size, and its errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from bubblefree.core import ValueKind
from bubblefree.skills import Kind, LocationCodec, RegionHeadCodec, WordTokenizer, demo_tokenizer
from bubblefree.skills.codec import CodecError, box_from_centre, location_tokens, size_slots

TOK = demo_tokenizer()
CODEC = LocationCodec.for_tokenizer(TOK)
N, M = len(CODEC.coord_ids), len(CODEC.size_ids)
unit = st.floats(0.0, 1.0)


def test_every_bin_round_trips_exactly():
    for kind in (Kind.X, Kind.Y):
        assert all(CODEC.encode(kind, CODEC.decode(kind, t)) == t for t in CODEC.coord_ids)
    assert all(CODEC.encode(Kind.SIZE, CODEC.decode(Kind.SIZE, t)) == t for t in CODEC.size_ids)
    assert CODEC.decode(Kind.SIZE, CODEC.size_ids[-1]) == 1.0
    assert math.isclose(CODEC.decode(Kind.SIZE, CODEC.size_ids[0]), CODEC.min_size)


@given(unit, st.sampled_from([Kind.X, Kind.Y]))
def test_coordinates_round_trip_within_half_a_bin(v, kind):
    t = CODEC.encode(kind, v)
    assert t in CODEC.ids(kind)
    assert abs(CODEC.decode(kind, t) - v) <= 0.5 / N + 1e-12


@given(st.floats(1.0 / 1024, 1.0))
def test_sizes_round_trip_within_half_a_log_bin(s):
    back = CODEC.decode(Kind.SIZE, CODEC.encode(Kind.SIZE, s))
    half_step = (1 / CODEC.min_size) ** (0.5 / (M - 1))
    ratio = back / s  # within half a log bin either side
    assert half_step ** -1 - 1e-9 <= ratio <= half_step + 1e-9


@given(st.floats(-10, 10), st.sampled_from(list(Kind)))
def test_out_of_range_values_clamp_to_the_edge_bins(v, kind):
    back = CODEC.decode(kind, CODEC.encode(kind, v))
    assert 0.0 < back <= 1.0


def test_bad_values_and_tokens_raise():
    with pytest.raises(CodecError):
        CODEC.encode(Kind.X, float("nan"))
    with pytest.raises(CodecError):
        CODEC.decode(Kind.SIZE, CODEC.coord_ids[0])  # a coordinate is no size
    with pytest.raises(CodecError, match="location tokens"):
        LocationCodec.for_tokenizer(WordTokenizer.build(["a", "b"]))


@given(unit, unit, unit, unit)
def test_boxes_are_centre_plus_minus_half_size_clamped(cx, cy, w, h):
    b = box_from_centre(cx, cy, w, h)
    assert 0.0 <= b["x_min"] <= b["x_max"] <= 1.0 and 0.0 <= b["y_min"] <= b["y_max"] <= 1.0
    if w / 2 <= cx <= 1 - w / 2:
        assert math.isclose(b["x_max"] - b["x_min"], w, abs_tol=1e-12)
        assert math.isclose((b["x_max"] + b["x_min"]) / 2, cx, abs_tol=1e-12)
    if h / 2 <= cy <= 1 - h / 2:
        assert math.isclose(b["y_max"] - b["y_min"], h, abs_tol=1e-12)


@given(unit, unit, st.floats(1 / 64, 1.0), st.floats(1 / 64, 1.0))
def test_a_box_survives_the_token_round_trip(cx, cy, w, h):
    toks = [CODEC.encode(k, v) for k, v in zip((Kind.X, Kind.Y, Kind.SIZE, Kind.SIZE),
                                                (cx, cy, w, h))]
    vals = [CODEC.decode(k, t) for k, t in zip((Kind.X, Kind.Y, Kind.SIZE, Kind.SIZE), toks)]
    b, want = box_from_centre(*vals), box_from_centre(cx, cy, w, h)
    # Coordinates are off by half a bin at most, sizes by half a log bin.
    tol = 0.5 / N + max(w, h) * ((1 / CODEC.min_size) ** (0.5 / (M - 1)) - 1)
    assert all(abs(b[k] - want[k]) <= tol + 1e-12 for k in b)


@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False))
def test_a_region_head_codec_decodes_values_clamped(v, w):
    codec = RegionHeadCodec(vocab_size=10, eos_id=3)
    # Any token but EOS carries a value (the token is not read); none is reserved.
    assert codec.ids(Kind.X) == codec.ids(Kind.Y) == codec.ids(Kind.SIZE) == set(range(10)) - {3}
    assert codec.spatial_ids() == set()
    assert codec.value_kind(Kind.X) is codec.value_kind(Kind.Y) is ValueKind.COORD
    assert codec.value_kind(Kind.SIZE) is ValueKind.SIZE
    assert codec.decode(Kind.X, 5, v) == min(1.0, max(0.0, v))
    assert codec.decode(Kind.SIZE, 7, (v, w)) == (min(1.0, max(0.0, v)), min(1.0, max(0.0, w)))
    assert CODEC.value_kind(Kind.X) is None and CODEC.value_kind(Kind.SIZE) is None


def test_a_region_head_codec_needs_its_value():
    codec = RegionHeadCodec(vocab_size=10, eos_id=3)
    with pytest.raises(CodecError, match="without a decoded value"):
        codec.decode(Kind.X, 5, None)
    with pytest.raises(CodecError, match=r"without a \(width, height\) value"):
        codec.decode(Kind.SIZE, 5, 0.5)
    with pytest.raises(CodecError, match="not in a vocabulary"):
        RegionHeadCodec(vocab_size=3, eos_id=3)
    assert size_slots(codec) == (Kind.SIZE,) and size_slots(CODEC) == (Kind.SIZE, Kind.SIZE)


def test_location_token_names():
    names = location_tokens(4, 2)
    assert names == ("<loc_0>", "<loc_1>", "<loc_2>", "<loc_3>", "<size_0>", "<size_1>")
    small = LocationCodec.for_tokenizer(WordTokenizer.build(names), coord_bins=4, size_bins=2)
    assert small.decode(Kind.X, small.encode(Kind.X, 0.6)) == 0.625
