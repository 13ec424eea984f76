"""Images as clients send them: ``data:<type>;base64,<data>`` URIs.

An image model gets the decoded image as an ``ImageRef`` (``read_image``).
A text model takes no images, but a bad one is still named as bad first
(not base64, not an image, over the pixel limit), so the caller learns the
most specific thing that is wrong. The image is checked by the project's one
image reader, ``bubblefree.images.load_image``, with the server's pixel
limit: the same refusals, decompression bombs included, as a caller of the
Python API gets.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from PIL import Image

from bubblefree.core import ImageRef, InvalidRequest
from bubblefree.images import load_image
from bubblefree.server.body import kind_of
from bubblefree.server.errors import ApiError


async def read_image(served, url: object, field: str) -> ImageRef:
    """The request's image, checked (``check_image``) and made the engine's
    ``ImageRef`` in a worker thread: decoding and cropping a large image must
    not stall the event loop."""
    settings = served.settings

    def read() -> ImageRef:
        image = check_image(url, field, served.takes_images, settings.max_image_pixels)
        try:
            return served.engine.images.ref(image)
        except InvalidRequest as err:
            raise ApiError(422, f"{field}: {str(err).removeprefix('image: ')}", field) from None
    return await asyncio.to_thread(read)


def check_image(url: object, field: str, takes_images: bool, max_pixels: int) -> Image.Image:
    """The decoded RGB image, or a 422 naming ``field``."""
    if not isinstance(url, str):
        raise ApiError(422, f"{field}: must be a data URI string, got {kind_of(url)}", field)
    head, comma, data = url.partition(",")
    # Any case: a URI's scheme (RFC 3986) and the ";base64" token (RFC 2397's
    # grammar, whose literals ABNF matches without case) spell the same URI.
    head = head.lower()
    if not (head.startswith("data:") and head.endswith(";base64") and comma):
        raise ApiError(422, f"{field}: must be a data URI (data:image/...;base64,...); "
                       "this server fetches no URLs", field)
    try:
        raw = _base64(data)
    except (binascii.Error, ValueError):
        raise ApiError(422, f"{field}: not valid base64", field) from None
    try:
        image = load_image(raw, max_pixels=max_pixels)
    except InvalidRequest as err:  # "image: <why>", named here by the request's field
        raise ApiError(422, f"{field}: {str(err).removeprefix('image: ')}", field) from None
    if not takes_images:
        raise ApiError(422, f"{field}: this model takes no images; ask without one", field)
    return image


# ASCII whitespace inside a data URI's base64: the line breaks every 76
# characters that the ``base64`` command and MIME encoders write.
_SPACE = str.maketrans("", "", " \t\r\n\f\v")


def _base64(data: str) -> bytes:
    """A data URI's base64 as browsers read it: whitespace dropped, missing
    ``=`` padding supplied; any other character not of base64 refused."""
    compact = data.translate(_SPACE)
    return base64.b64decode(compact + "=" * (-len(compact) % 4), validate=True)
