"""Images and values on the simulated GPU, as ints the fake model can hash.

An image's ``source`` is a fingerprint: an int, or something the fake turns
into one deterministically (``fingerprint``; never Python's salted
``hash()``). Its prefix's KV positions hold *markers*, negative ints derived
from the fingerprint and the position, written by the IMAGE_PREFILL forward
as prompt entries: the model reads them back like prompt tokens, so an image
changes every later token, and a wrong page table shows as KV corruption.

A value row's next decode input is a marker of the value (the region
encoder's output on a GPU), not the sampled token: later tokens depend on
the value, and a backend that fed the token instead would answer otherwise.
Markers are negative, so they never collide with a vocabulary id.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from bubblefree.core.values import ImageRef, InvalidRequest, ValueKind
from bubblefree.fake_backend.hashing import stable_hash

_SPAN = 1 << 40
_KIND_CODE = {ValueKind.COORD: 1, ValueKind.SIZE: 2}


def fingerprint(source: Any) -> int:
    """A 64-bit int for an image source: an int as it is; bytes, str, an
    image with ``tobytes()`` (PIL, NumPy) by their content; a tuple of those
    by its parts. Raises ``TypeError`` for anything else."""
    if isinstance(source, int) and not isinstance(source, bool):
        return source & ((1 << 64) - 1)
    if isinstance(source, str):
        source = source.encode()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return int.from_bytes(hashlib.sha256(bytes(source)).digest()[:8], "little")
    if isinstance(source, tuple):
        return stable_hash(0x7E, len(source), *map(fingerprint, source))
    if callable(getattr(source, "tobytes", None)):
        shape = getattr(source, "size", None), getattr(source, "mode", None), getattr(source, "shape", None)
        return stable_hash(fingerprint(repr(shape)), fingerprint(source.tobytes()))
    raise TypeError(f"cannot fingerprint an image source of type {type(source).__name__}")


def image_ref(image: Any, length: int) -> ImageRef:
    """The fake's ``image_ref``: ``length`` prefix positions, the fingerprint
    as the source. Pure, so any thread may call it."""
    try:
        return ImageRef(length=length, source=fingerprint(image))
    except TypeError as err:
        raise InvalidRequest(f"image: {err}") from None


def image_markers(fp: int, length: int) -> tuple[int, ...]:
    """What the prefix's KV positions hold for the image ``fp``."""
    return tuple(-1 - _SPAN - stable_hash(0x1A, fp, i) % _SPAN for i in range(length))


def with_values(tokens: tuple[int, ...], prompt_values: tuple) -> tuple[int, ...]:
    """A prompt as the forward reads it: each ``PromptValue``'s position
    holds its value's marker (its encoding on a GPU), not the placeholder."""
    out = list(tokens)
    for pv in prompt_values:
        out[pv.index] = value_marker(pv.kind, pv.value)
    return tuple(out)


def value_marker(kind: ValueKind, value: float | tuple[float, float]) -> int:
    """The next decode input after a row decoded ``value`` of ``kind``."""
    parts = value if isinstance(value, tuple) else (value,)
    bits = [int.from_bytes(struct.pack("<d", float(v)), "little") for v in parts]
    return -1 - stable_hash(0x7A, _KIND_CODE[kind], *bits) % _SPAN
