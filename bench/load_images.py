"""Fresh images for the load, sent as moondream's client sends them: a
JPEG (quality 95) in a ``data:image/jpeg;base64,...`` URI.

They are made before the timing starts. Encoding a JPEG costs the client
milliseconds, and at hundreds of requests a second that would make the load
generator, not the server, what is measured. Each image is random: a
coarse grid of random colours scaled to ``side`` px, about a photo's size
as a JPEG (noise in every pixel would be four times that, and nothing a
camera sends). The server keeps no image cache: it decodes, crops and
encodes every request's image in full, so an image is fresh to it however
it was made.
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

GRID = 42  # random colours across; 378 / 42 = 9 px a cell


def data_uri(image: Image.Image) -> str:
    """What ``moondream.vl(...).encode_image`` sends."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=95)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def pool(count: int, side: int, seed: int) -> list[str]:
    """``count`` different random ``side``-px images, as data URIs."""
    rng = np.random.default_rng(seed)
    cells = min(GRID, side)
    return [data_uri(Image.fromarray(rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8))
                     .resize((side, side), Image.BILINEAR)) for _ in range(count)]
