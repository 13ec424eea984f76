"""Images as clients send them: ``data:<type>;base64,<data>`` URIs.

A text model takes no images, but a bad one is still named as bad first
(not base64, not an image), so the caller learns the most specific thing
that is wrong. The check reads the file's signature only: decoding the
pixels is the vision model's job, when there is one.
"""

from __future__ import annotations

import base64
import binascii

from bubblefree.server.errors import ApiError

_SIGNATURES = ((b"\xff\xd8\xff", "jpeg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF87a", "gif"),
               (b"GIF89a", "gif"), (b"BM", "bmp"))


def check_image(url: object, field: str, takes_images: bool) -> bytes:
    """The image's bytes, or a 422 naming ``field``."""
    if not isinstance(url, str):
        raise ApiError(422, f"{field}: must be a data URI string, got {type(url).__name__}", field)
    head, comma, data = url.partition(",")
    if not (head.startswith("data:") and head.endswith(";base64") and comma):
        raise ApiError(422, f"{field}: must be a data URI (data:image/...;base64,...); "
                       "this server fetches no URLs", field)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(422, f"{field}: not valid base64", field) from None
    if not _is_image(raw):
        raise ApiError(422, f"{field}: the data is not an image (JPEG, PNG, GIF, WebP or BMP)", field)
    if not takes_images:
        raise ApiError(422, f"{field}: this model takes no images; ask without one", field)
    return raw


def _is_image(raw: bytes) -> bool:
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return True
    return any(raw.startswith(sig) for sig, _ in _SIGNATURES)
