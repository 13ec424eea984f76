"""Crops of odd image sizes: how many, where, and the feature grid's round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bubblefree.cuda_backend.moondream.config import MOONDREAM2
from bubblefree.cuda_backend.moondream.image_crops import overlap_crops, overlap_crops_on, plan_crops, reconstruct
from tests.image_world import lanczos_by_axis

VISION = MOONDREAM2.vision

# (width, height) -> (rows, cols), worked by hand from the rule: the
# interior is the image less 2 x 56 px; 266 px per tile; <= 12 tiles.
CASES = {
    (1, 1): (1, 1),
    (377, 379): (1, 1),      # interior 265 wide: one tile across, so one in all
    (1000, 300): (1, 1),     # interior 188 high
    (3000, 20): (1, 1),
    (800, 600): (2, 4),      # needs 2 x 3; room for 2 x 4 at this aspect
    (1000, 1000): (3, 3),    # needs 4 x 4 = 16 > 12: scaled by sqrt(12/16)
    (3000, 400): (1, 8),     # needs 2 x 11 = 22 > 12: scaled by sqrt(12/22)
    (1176, 644): (2, 4),     # exactly 2 x 4 tiles plus the margins
}


@pytest.mark.parametrize("size", list(CASES))
def test_the_plan_tiles_the_resized_image_with_full_overlapping_windows(size):
    width, height = size
    plan = plan_crops(height, width, VISION)
    rows, cols = CASES[size]
    assert plan.tiling == (rows, cols)
    assert plan.n_crops == rows * cols + 1 <= 13
    assert plan.resized == (rows * 266 + 112, cols * 266 + 112)
    assert plan.windows == tuple((i * 266, i * 266 + 378, j * 266, j * 266 + 378)
                                 for i in range(rows) for j in range(cols))
    # Neighbours share 2 x 56 px; the last window ends on the image's edge.
    assert plan.windows[-1][1] == plan.resized[0] and plan.windows[-1][3] == plan.resized[1]


@pytest.mark.parametrize("size", [(1, 1), (377, 379), (3000, 20)])
def test_crops_of_odd_sizes_are_full_squares(size):
    image = Image.new("RGB", size, (200, 10, 30))
    crops, plan = overlap_crops(image, VISION)
    assert crops.shape == (2, 378, 378, 3) and crops.dtype == torch.uint8
    assert plan.tiling == (1, 1)
    assert torch.equal(crops[:, 189, 189], torch.tensor([[200, 10, 30]] * 2, dtype=torch.uint8))


def test_crops_cut_their_windows_out_of_an_image_already_at_the_resized_size():
    pixels = np.random.default_rng(0).integers(0, 256, (644, 1176, 3), dtype=np.uint8)
    crops, plan = overlap_crops(Image.fromarray(pixels), VISION)
    assert plan.resized == (644, 1176) and crops.shape == (9, 378, 378, 3)
    for k, (y0, y1, x0, x1) in enumerate(plan.windows):
        assert np.array_equal(crops[k + 1].numpy(), pixels[y0:y1, x0:x1])


def lanczos(image: Image.Image, width: int, height: int) -> np.ndarray:
    return lanczos_by_axis(image, height, width)


@pytest.mark.parametrize("size", [(378, 378), (300, 500), (500, 300), (900, 700)])
def test_crops_equal_lanczos_resizes_written_out(size):
    """The global view is the image resized to 378 px; the local crops are
    windows of the image resized to the plan's size, whatever shortcut
    (no resize at the right size, one resize for both views) is taken."""
    pixels = np.random.default_rng(size[0]).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    crops, plan = overlap_crops(image, VISION)
    assert np.array_equal(crops[0].numpy(), lanczos(image, 378, 378))
    height, width = plan.resized
    local = lanczos(image, width, height)
    for k, (y0, y1, x0, x1) in enumerate(plan.windows):
        assert np.array_equal(crops[k + 1].numpy(), local[y0:y1, x0:x1])
    assert np.array_equal(np.asarray(image), pixels)  # the caller's image untouched


@pytest.mark.parametrize("size", [(378, 378), (300, 200), (90, 1000), (700, 400)])
def test_crops_cut_on_a_device_equal_the_hosts(size):
    """``overlap_crops_on`` (the resizes as matrix products, the windows as
    one unfold) gives the host's crops pixel for pixel: one crop, a tall
    and a wide single view, and a 2 x 4 grid of windows."""
    width, height = size
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    want, plan = overlap_crops(Image.fromarray(pixels), VISION)
    got, got_plan = overlap_crops_on(torch.from_numpy(pixels), VISION)
    assert got_plan == plan and torch.equal(got, want)


def test_crops_on_a_device_refuse_what_is_not_uint8_rgb():
    for bad in (torch.zeros(4, 4, 3), torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 4, 4, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="uint8 \\[H, W, 3\\]"):
            overlap_crops_on(bad, VISION)


def test_overlap_crops_refuses_a_non_rgb_image():
    with pytest.raises(ValueError, match="RGB"):
        overlap_crops(Image.new("L", (10, 10)), VISION)


@pytest.mark.parametrize("size", list(CASES))
def test_reconstruction_of_a_known_grid_round_trips(size):
    width, height = size
    plan = plan_crops(height, width, VISION)
    rows, cols = plan.tiling
    # A feature grid with a distinct value in every cell and channel.
    grid = torch.arange((rows * 19 + 8) * (cols * 19 + 8) * 2, dtype=torch.float32)
    grid = grid.reshape(rows * 19 + 8, cols * 19 + 8, 2)
    # Each crop sees its pixel window, in patches.
    local = torch.stack([grid[y0 // 14:y1 // 14, x0 // 14:x1 // 14]
                         for y0, y1, x0, x1 in plan.windows])
    assert local.shape == (rows * cols, 27, 27, 2)
    assert torch.equal(reconstruct(local, plan.tiling, 4), grid)


def test_reconstruction_takes_each_cell_from_the_crop_that_owns_it():
    # Crop k filled with k: the owner of each cell is visible in the output.
    local = torch.arange(6, dtype=torch.float32).reshape(6, 1, 1, 1).expand(6, 27, 27, 1)
    out = reconstruct(local, (2, 3), 4)[..., 0]                            # [46, 65]
    assert out.shape == (46, 65)
    assert out[0, 0] == 0 and out[22, 22] == 0 and out[22, 23] == 1 and out[23, 0] == 3
    assert out[45, 64] == 5 and out[0, 42] == 2 and out[0, 41] == 1


def test_reconstruction_refuses_the_wrong_number_of_crops():
    with pytest.raises(ValueError, match="expected 6"):
        reconstruct(torch.zeros(5, 27, 27, 1), (2, 3), 4)


def test_prepare_falls_back_to_the_host_when_the_device_is_full(monkeypatch):
    """With a crop stream, a device out of memory is no reason to refuse an
    image: the host's Pillow path makes the same crops. Any other error is
    not swallowed."""
    from bubblefree.cuda_backend.moondream import prepared

    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    want, plan = overlap_crops(image, VISION)

    def full(*_):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(prepared, "_prepare_on", full)
    got = prepared.prepare(image, VISION, pin=False, stream=object())
    assert torch.equal(got.crops, want) and got.tiling == plan.tiling

    def broken(*_):
        raise RuntimeError("a bug")
    monkeypatch.setattr(prepared, "_prepare_on", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        prepared.prepare(image, VISION, pin=False, stream=object())
    # An image already at the crop size needs no resize: the host cuts it, no device asked.
    square = Image.fromarray(np.zeros((378, 378, 3), dtype=np.uint8))
    assert prepared.prepare(square, VISION, pin=False, stream=object()).crops.shape == (2, 378, 378, 3)


def test_a_tall_thin_image_is_never_blown_up_between_its_passes(monkeypatch):
    """1 x 200,000 px: resized width first, its middle image was 378 times
    its size (75.6 megapixels; a 1 x 11M image took 215 s and 12.9 GB,
    within the pixel limit). The height goes first now: no image in between
    is larger than the input or the output."""
    sizes = []
    original = Image.Image.resize

    def recording(self, size, *args, **kwargs):
        sizes.append(size[0] * size[1])
        return original(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recording)
    image = Image.new("RGB", (1, 200_000), (90, 120, 30))
    crops, plan = overlap_crops(image, VISION)
    assert crops.shape[1:] == (378, 378, 3)
    assert max(sizes) <= max(image.width * image.height, 378 * 378, plan.resized[0] * plan.resized[1])


def test_an_image_whose_device_matrices_would_be_huge_is_cut_on_the_host(monkeypatch):
    """The device's resizes are dense [out, in] matrices: for 1 x 2,000,000
    px they would take gigabytes, so such an image is cut on the host."""
    from bubblefree.cuda_backend.moondream import prepared

    assert prepared._fits_on_device(756, 756, VISION)
    assert prepared._fits_on_device(378, 30_000, VISION)
    assert not prepared._fits_on_device(2_000_000, 1, VISION)
    on_device = []
    monkeypatch.setattr(prepared, "_prepare_on", lambda *a: on_device.append(a))
    image = Image.new("RGB", (1, 2_000_000), (9, 9, 9))
    out = prepared.prepare(image, VISION, pin=False, stream=object())  # a stream: the device path is on
    assert not on_device and out.crops.shape[1:] == (378, 378, 3)
    prepared.prepare(Image.new("RGB", (500, 400)), VISION, pin=False, stream=object())
    assert len(on_device) == 1  # an ordinary image still goes to the device
