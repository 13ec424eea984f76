"""Image input: whatever a caller hands us -> one RGB ``PIL.Image``.

Accepted: a ``PIL.Image.Image``, a path (``str`` or ``os.PathLike``),
encoded bytes (``bytes``, ``bytearray``, ``memoryview``), or an array with
``__array_interface__`` (numpy): ``[H, W]``, ``[H, W, 1|3|4]`` of uint8,
``[H, W]`` of bool, uint16 or float32.

Normalized: EXIF orientation applied (a photo taken sideways is seen the
way its viewer shows it); the first frame of an animation; transparency
composited over white (what a viewer shows, not the colour hidden under
transparent pixels); 16-bit grey scaled to 8 bits; 32-bit integer and
float grey stretched from their range to 0..255; palette, CMYK and the
other 8-bit modes converted by Pillow.

Refused, with ``InvalidRequest`` naming ``image``: anything that is not an
image, an empty or truncated file, a zero-size image, more than
``max_pixels`` pixels (checked from the header, before decoding, so a
decompression bomb costs nothing), a mode with no RGB meaning, non-finite
float pixels. Pillow is imported here and nowhere in the core (without it,
``import bubblefree`` works and an image raises ImportError naming the
extra), and this module imports no numpy: arrays are read through their
interface.
"""

from __future__ import annotations

import array
import io
import math
import os
import warnings

try:
    from PIL import Image, ImageOps
except ImportError:  # the images extra is absent: text engines serve without it
    Image = ImageOps = None

from bubblefree.core import InvalidRequest

DEFAULT_MAX_PIXELS = 50_000_000


def pillow_max_pixels() -> int | None:
    """The most pixels Pillow decodes at all (twice its warning threshold;
    None where Pillow is absent or its check is off): a ``max_pixels`` past
    it would never be honoured, Pillow refusing first in its own words."""
    if Image is None or Image.MAX_IMAGE_PIXELS is None:
        return None
    return 2 * int(Image.MAX_IMAGE_PIXELS)

_WHITE = (255, 255, 255)
# Modes Pillow converts to RGB with their ordinary meaning.
_DIRECT = {"RGB", "L", "1", "P", "CMYK", "YCbCr", "RGBX"}
_ORIENTATION = 0x0112  # the EXIF tag exif_transpose applies
_ALPHA = {"RGBA", "LA", "PA", "RGBa", "La"}
_SIXTEEN = {"I;16", "I;16L", "I;16B", "I;16N"}
_WIDE = {"I", "F"}
_ARRAY_KINDS = {("u1", 2), ("u1", 3), ("b1", 2), ("u2", 2), ("f4", 2)}


def _refuse(reason: str, cause: BaseException | None = None) -> InvalidRequest:
    error = InvalidRequest(f"image: {reason}")
    error.__cause__ = cause
    return error


def _open_encoded(source, what: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            # Our own max_pixels check replaces Pillow's warning threshold.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(source)
    except Image.DecompressionBombError as ex:
        raise _refuse(f"{what} is too large to decode safely ({ex})", ex) from ex
    except MemoryError:
        raise
    except Exception as ex:  # only Pillow's parsers run here: see _decode
        raise _refuse(f"{what} is not an image Pillow can read", ex) from ex


def _from_path(path) -> Image.Image:
    name = os.fspath(path)
    if not os.path.exists(name):
        raise _refuse(f"no file at {name!r}")
    if not os.path.isfile(name):
        raise _refuse(f"{name!r} is not a file")
    if os.path.getsize(name) == 0:
        raise _refuse(f"{name!r} is empty")
    with open(name, "rb") as f:
        # Its header first: a large file that is not an image (or a bomb)
        # was read whole before it was refused, 2 GiB in 8 s.
        _open_encoded(f, f"the file {name!r}")
        f.seek(0)
        # Then whole, so the returned image holds no open file.
        return _open_encoded(io.BytesIO(f.read()), f"the file {name!r}")


def _from_bytes(data) -> Image.Image:
    data = bytes(data)
    if not data:
        raise _refuse("empty bytes")
    return _open_encoded(io.BytesIO(data), "the data")


def _from_array(array) -> Image.Image:
    face = array.__array_interface__
    shape, kind = tuple(face["shape"]), face["typestr"][1:]
    if len(shape) == 3 and shape[2] == 1:  # [H, W, 1]: the grey [H, W] it holds
        array = array.reshape(shape[:2]) if hasattr(array, "reshape") else _Grey(array, face)
        shape = shape[:2]
    if (kind, len(shape)) not in _ARRAY_KINDS or (len(shape) == 3 and shape[2] not in (3, 4)):
        raise _refuse(f"an array of shape {shape} and dtype {face['typestr']!r} is not an image; "
                      "expected [H, W] or [H, W, 1|3|4] uint8, or [H, W] bool, uint16 or float32")
    if 0 in shape:
        raise _refuse(f"zero-size array {shape}")
    try:
        return Image.fromarray(array)
    except (TypeError, ValueError) as ex:
        raise _refuse(f"the array cannot be read as an image ({ex})", ex) from ex


class _Grey:
    """An ``[H, W, 1]`` array without ``reshape`` seen as ``[H, W]`` through
    its interface: Pillow reads it by ``tobytes`` (its bytes in C order, the
    same for the one channel), or refuses it where the array has none."""

    def __init__(self, owner, face: dict):
        self._owner = owner
        h, w, _ = face["shape"]
        size = int(face["typestr"][2:])
        strides = face.get("strides") or (w * size, size, size)
        self.__array_interface__ = {**face, "shape": (h, w), "strides": tuple(strides[:2])}

    def tobytes(self) -> bytes:
        if not hasattr(self._owner, "tobytes"):
            raise TypeError(f"a {type(self._owner).__name__} of shape [H, W, 1] has neither reshape nor "
                            "tobytes")
        return self._owner.tobytes()


def _stretch(image: Image.Image) -> Image.Image:
    """32-bit int or float grey -> L, mapping [min, max] onto [0, 255]."""
    # getextrema skips NaN, so floats are checked one by one (F images are
    # rare, and a linear pass costs far less than the model's forward).
    if image.mode == "F" and not all(map(math.isfinite, array.array("f", image.tobytes()))):
        raise _refuse("float pixels must be finite")
    low, high = image.getextrema()
    if high == low:
        return Image.new("L", image.size, int(min(max(low, 0), 255)))
    scale = 255.0 / (high - low)
    return image.point(lambda v: v * scale - low * scale).convert("L")


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode in _ALPHA or (mode in ("P", "L", "RGB") and "transparency" in image.info):
        # Premultiplied grey has no direct way to RGBA; its plain form does.
        rgba = (image.convert("LA") if mode == "La" else image).convert("RGBA")
        background = Image.new("RGBA", image.size, _WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode == "RGB":  # read only from here on: no copy
        return image
    if mode in _DIRECT:
        return image.convert("RGB")
    if mode in _SIXTEEN:
        return image.convert("I").point(lambda v: v / 256).convert("L").convert("RGB")
    if mode in _WIDE:
        return _stretch(image).convert("RGB")
    raise _refuse(f"unsupported image mode {mode!r}")


def load_image(image, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """``image`` (see the module's docstring) -> a decoded RGB image."""
    if Image is None:
        raise ImportError("images need Pillow: pip install 'bubblefree[images]'")
    if isinstance(image, Image.Image):
        opened = image
    elif isinstance(image, (str, os.PathLike)):
        opened = _from_path(image)
    elif isinstance(image, (bytes, bytearray, memoryview)):
        opened = _from_bytes(image)
    elif hasattr(image, "__array_interface__"):
        opened = _from_array(image)
    else:
        raise _refuse(f"expected a PIL image, a path, bytes or an array, got {type(image).__name__}")
    width, height = opened.size
    if width <= 0 or height <= 0:
        raise _refuse(f"zero-size image {width}x{height}")
    if width * height > max_pixels:
        raise _refuse(f"{width}x{height} is {width * height} pixels, over the limit of {max_pixels}")
    return _to_rgb(_decode(opened))


def _decode(opened: Image.Image) -> Image.Image:
    """The pixels, turned upright by the EXIF orientation. Only Pillow's
    decoders and EXIF parser run here, over the caller's bytes, and on
    malformed input they fail with nearly any exception (OSError for a
    truncated file, NotImplementedError for an unknown DDS format,
    struct.error, TypeError or AttributeError for EXIF values of the wrong
    type): each is the image's fault, refused naming it. MemoryError is the
    server's, and passes."""
    try:
        opened.load()                       # decode now: a truncated file fails here
        # exif_transpose copies even an upright image; most have no turn to apply.
        turned = opened.getexif().get(_ORIENTATION, 1) not in (0, 1)
        return ImageOps.exif_transpose(opened) if turned else opened
    except MemoryError:
        raise
    except Exception as ex:
        raise _refuse(f"cannot decode the image ({ex})", ex) from ex
