"""Image input through Pillow: what is accepted and how it is normalized,
and every kind of bad image refused with InvalidRequest naming ``image``."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from bubblefree.core import InvalidRequest
from bubblefree.images import load_image


def _encoded(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


# --- accepted -------------------------------------------------------------

def test_a_path_bytes_an_image_and_an_array_give_the_same_pixels(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    data = _encoded(image)
    (tmp_path / "x.png").write_bytes(data)
    for source in (image, data, bytearray(data), memoryview(data), str(tmp_path / "x.png"),
                   tmp_path / "x.png", pixels):
        out = load_image(source)
        assert out.mode == "RGB" and out.size == (7, 5)
        assert np.array_equal(np.asarray(out), pixels), type(source)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (4, 2), (255, 0, 0))
    image.putpixel((0, 0), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6                        # stored sideways: rotate 90 degrees clockwise
    out = load_image(_encoded(image, "PNG", exif=exif))
    assert out.size == (2, 4)
    assert out.getpixel((1, 0)) == (0, 0, 255)   # the top-left corner went top-right


def test_transparency_is_composited_over_white():
    image = Image.new("RGBA", (2, 1), (10, 20, 30, 0))
    image.putpixel((1, 0), (10, 20, 30, 255))
    out = load_image(image)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (10, 20, 30)
    assert load_image(Image.new("LA", (1, 1), (0, 0))).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (1, 1), 0)
    palette.info["transparency"] = 0
    assert load_image(palette).getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("image,expected", [
    (Image.new("L", (1, 1), 77), (77, 77, 77)),
    (Image.new("I;16", (1, 1), 40000), (156, 156, 156)),           # 40000 / 256
    (Image.new("CMYK", (1, 1), (0, 255, 255, 0)), (255, 0, 0)),
    (Image.new("1", (1, 1), 1), (255, 255, 255)),
    (Image.new("P", (1, 1), 0), (0, 0, 0)),
], ids=["L", "I;16", "CMYK", "1", "P"])
def test_modes_convert_to_rgb(image, expected):
    out = load_image(image)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == expected


def test_wide_grey_is_stretched_over_its_range():
    for mode, values in (("I", [-5, 5, 1000]), ("F", [0.0, 0.5, 1.0])):
        image = Image.new(mode, (3, 1))
        for x, v in enumerate(values):
            image.putpixel((x, 0), v)
        out = load_image(image)
        assert out.getpixel((0, 0)) == (0, 0, 0) and out.getpixel((2, 0)) == (255, 255, 255), mode
    assert load_image(Image.new("I", (1, 1), 300)).getpixel((0, 0)) == (255, 255, 255)


def test_grey_and_rgba_arrays():
    assert load_image(np.full((2, 3), 9, np.uint8)).getpixel((0, 0)) == (9, 9, 9)
    assert load_image(np.full((2, 3, 1), 9, np.uint8)).size == (3, 2)
    assert load_image(np.full((1, 1, 4), 255, np.uint8)).getpixel((0, 0)) == (255, 255, 255)
    assert load_image(np.ones((1, 1), bool)).getpixel((0, 0)) == (255, 255, 255)


def test_the_first_frame_of_an_animation():
    frames = [Image.new("P", (2, 2), i) for i in (1, 2)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert load_image(buf.getvalue()).size == (2, 2)


# --- refused --------------------------------------------------------------

def _truncated() -> bytes:
    pixels = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = _encoded(Image.fromarray(pixels))
    return data[:len(data) // 2]


def _file(path, data: bytes):
    path.write_bytes(data)
    return path


def _png_header(width: int, height: int) -> bytes:
    # A PNG that claims width x height 8-bit grey pixels and holds none:
    # refusing it proves the limit is checked before decoding.
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


BAD = {
    "wrong type": lambda tmp: 42,
    "none": lambda tmp: None,
    "list": lambda tmp: [[0, 0, 0]],
    "missing path": lambda tmp: str(tmp / "absent.png"),
    "directory": lambda tmp: tmp,
    "empty file": lambda tmp: _file(tmp / "empty.png", b""),
    "text file": lambda tmp: _file(tmp / "a.png", b"not an image"),
    "empty bytes": lambda tmp: b"",
    "random bytes": lambda tmp: bytes(range(256)) * 4,
    "truncated": lambda tmp: _truncated(),
    "zero-size image": lambda tmp: Image.new("RGB", (0, 5)),
    "zero-size array": lambda tmp: np.zeros((0, 4, 3), np.uint8),
    "unsupported mode": lambda tmp: Image.new("HSV", (2, 2)),
    "array of 5 channels": lambda tmp: np.zeros((2, 2, 5), np.uint8),
    "1-d array": lambda tmp: np.zeros(12, np.uint8),
    "float rgb array": lambda tmp: np.zeros((2, 2, 3), np.float64),
    "complex array": lambda tmp: np.zeros((2, 2), np.complex64),
    "non-finite floats": lambda tmp: np.array([[0.0, np.nan]], np.float32),
    "decompression bomb": lambda tmp: _png_header(100_000, 100_000),
    "header with no pixel data": lambda tmp: _png_header(8, 8),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_image_is_refused_naming_image(kind, tmp_path):
    with pytest.raises(InvalidRequest, match=r"^image: "):
        load_image(BAD[kind](tmp_path))


def test_over_max_pixels_is_refused_before_decoding(tmp_path):
    with pytest.raises(InvalidRequest, match=r"^image: 10000x6000 is 60000000 pixels, over"):
        load_image(_png_header(10_000, 6_000))
    with pytest.raises(InvalidRequest, match=r"^image: 3x3 is 9 pixels, over the limit of 8"):
        load_image(Image.new("RGB", (3, 3)), max_pixels=8)
    assert load_image(Image.new("RGB", (3, 3)), max_pixels=9).size == (3, 3)


def test_a_large_file_that_is_no_image_is_refused_from_its_header(tmp_path):
    """It was read whole first: a 2 GiB file took 8 s and 2 GB of memory to
    be told it is not an image. (A sparse file: no disk is written.)"""
    import tracemalloc

    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match=r"^image: the file .* is not an image Pillow can read"):
            load_image(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    big = tmp_path / "big.png"  # an image's file is still read whole and decoded
    Image.new("RGB", (5, 4), "red").save(big)
    assert load_image(big).size == (5, 4)
