"""``resample.resize``: Pillow's 8-bit Lanczos, one axis after the other,
as float64 matrix products, checked pixel for pixel against Pillow itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from bubblefree.cuda_backend.moondream import resample
from bubblefree.cuda_backend.moondream.resample import PRECISION_BITS, resize, taps
from tests.image_world import lanczos_by_axis

sizes = st.integers(1, 80)


def pillow_by_axis(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    return lanczos_by_axis(Image.fromarray(pixels), height, width)


@pytest.mark.parametrize("h,w,height,width,first", [
    (756, 756, 378, 378, True), (50, 100, 378, 378, True), (2_000_000, 1, 378, 1, False),
    (1, 2_000_000, 1, 378, True), (3000, 20, 378, 3, False), (20, 3000, 3, 378, True),
])
def test_the_pass_order_leaves_the_smaller_image_between(h, w, height, width, first):
    assert resample.width_first(h, w, height, width) is first
    middle = width * h if first else w * height
    assert middle == min(width * h, w * height)


def content(seed: int, height: int, width: int, edges: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    # Black and white edges overshoot under Lanczos: they exercise the clamps.
    return (pixels > 127).astype(np.uint8) * 255 if edges else pixels


@given(sizes, sizes, sizes, sizes, st.integers(0, 2**32 - 1), st.booleans())
def test_resize_equals_pillow_one_axis_at_a_time(h, w, height, width, seed, edges):
    pixels = content(seed, h, w, edges)
    got = resize(torch.from_numpy(pixels), height, width).numpy()
    assert np.array_equal(got, pillow_by_axis(pixels, height, width))


@given(sizes, sizes, sizes, st.booleans(), st.integers(0, 2**32 - 1))
def test_one_axis_equals_pillows_own_resize(h, w, size, along_width, seed):
    """With one axis to change, Pillow's resize has no order to choose: the
    two must agree exactly, whatever Pillow's version."""
    pixels = content(seed, h, w, seed % 2 == 0)
    height, width = (h, size) if along_width else (size, w)
    want = np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.LANCZOS))
    assert np.array_equal(resize(torch.from_numpy(pixels), height, width).numpy(), want)


def test_large_resizes_as_the_crops_need_them():
    """The shapes a 756-px image takes: up to the 3 x 3 tiling's 910 px and
    down to the 378-px global view, in blocks smaller than the whole image."""
    pixels = content(3, 756, 756, False)
    for size in (910, 378):
        want = pillow_by_axis(pixels, size, size)
        assert np.array_equal(resize(torch.from_numpy(pixels), size, size).numpy(), want)


def test_blocks_bound_the_working_set_and_change_nothing(monkeypatch):
    pixels = content(5, 37, 53, False)
    whole = resize(torch.from_numpy(pixels), 61, 29)
    monkeypatch.setattr(resample, "CHUNK_ELEMENTS", 7)  # blocks of a row or less, both passes
    assert torch.equal(resize(torch.from_numpy(pixels), 61, 29), whole)


@pytest.mark.parametrize("in_size,out_size", [(1, 5), (5, 1), (756, 910), (756, 378), (4000, 378), (7, 7)])
def test_taps_are_normalized_windows_inside_the_axis(in_size, out_size):
    first, fixed = taps(in_size, out_size)
    assert first.shape == (out_size,) and fixed.shape[0] == out_size
    assert (first >= 0).all() and (first < in_size).all()
    used = fixed != 0
    last = first + np.where(used.any(axis=1), used.shape[1] - np.argmax(used[:, ::-1], axis=1), 0)
    assert (last <= in_size).all()
    # Each row sums to one in fixed point, up to the rounding of its weights.
    one = 1 << PRECISION_BITS
    assert (np.abs(fixed.sum(axis=1) - one) <= fixed.shape[1]).all()


def test_an_axis_of_the_same_size_is_left_as_it_is():
    pixels = torch.from_numpy(content(9, 12, 17, False))
    assert torch.equal(resize(pixels, 12, 17), pixels)


@pytest.mark.parametrize("bad", [torch.zeros(4, 4, 3), torch.zeros(4, 4, dtype=torch.uint8)])
def test_resize_names_what_it_needs(bad):
    with pytest.raises(ValueError, match="uint8"):
        resize(bad, 2, 2)


@pytest.mark.parametrize("in_size,out_size", [(0, 3), (3, 0)])
def test_taps_refuse_an_empty_axis(in_size, out_size):
    with pytest.raises(ValueError, match="positive"):
        taps(in_size, out_size)
