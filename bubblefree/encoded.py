"""Images on their way into a request: whatever a caller hands us -> an
``ImageRef`` the core carries, made on the caller's thread.

``EncodedImage`` is moondream's name for an image made ready once: pass it
in place of an image to ask many questions without decoding it again (and,
on a backend that keeps encoded features, without encoding it again). It
belongs to the engine that made it; another engine refuses it.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs

from bubblefree.core import ImageRef, InvalidRequest
from bubblefree.core.values import shown
from bubblefree.images import DEFAULT_MAX_PIXELS, load_image, pillow_max_pixels

NO_IMAGES = "image: this model takes no images; ask without one"


@attrs.frozen(eq=False)
class EncodedImage:
    """An image ready for requests (``Engine.encode_image``)."""

    ref: ImageRef
    width: int
    height: int
    _backend: Any = attrs.field(repr=False, alias="backend", converter=weakref.ref)

    def made_by(self, backend: Any) -> bool:
        return self._backend() is backend


def check_max_pixels(value: Any) -> int:
    """``max_image_pixels``, the decompression-bomb limit: an int >= 1, and
    no more than Pillow decodes (``pillow_max_pixels``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"max_image_pixels: must be an int >= 1, got {shown(value)}")
    if (most := pillow_max_pixels()) is not None and value > most:
        raise InvalidRequest(f"max_image_pixels: at most {most}, the most pixels Pillow decodes, "
                             f"got {value}")
    return value


@attrs.define
class ImageIntake:
    """The one way an image enters: refused at once on a backend that takes
    none (before any decoding), then ``load_image`` (EXIF, modes, the pixel
    limit; every refusal an ``InvalidRequest`` naming ``image``), then the
    backend's ``image_ref``, which is thread safe."""

    backend: Any
    max_pixels: int = attrs.field(default=DEFAULT_MAX_PIXELS)
    # The refs this intake made: an ``ImageRef`` passed in is taken only if
    # it is one. A ref built by hand, or by another engine, reached the
    # backend unchecked: its source unreadable there, the step failed as a
    # lost device and the engine stopped for every caller.
    _made: weakref.WeakSet = attrs.field(factory=weakref.WeakSet, init=False)

    @max_pixels.validator
    def _check(self, _, value: Any) -> None:
        check_max_pixels(value)

    @property
    def takes_images(self) -> bool:
        return bool(getattr(self.backend.capacity, "images", False))

    def ref(self, image: Any) -> ImageRef:
        """The ``ImageRef`` a request about ``image`` carries."""
        self._check_takes()
        if isinstance(image, ImageRef):
            if image not in self._made:
                raise InvalidRequest("image: an ImageRef this engine did not make; pass the image, or "
                                     "an EncodedImage from this engine's encode_image")
            return image
        if isinstance(image, EncodedImage):
            return self._own(image).ref
        return self._keep(self.backend.image_ref(self._load(image)))

    def encode(self, image: Any) -> EncodedImage:
        """``image`` made ready for many requests. A backend that keeps
        encoded features (``encode_image``: moondream's, which encodes once,
        on the device) makes its own; otherwise the ref is shared."""
        self._check_takes()
        if isinstance(image, EncodedImage):
            return self._own(image)
        pil = self._load(image)
        encode = getattr(self.backend, "encode_image", None)
        ref = self._keep(self.backend.image_ref(encode(pil) if encode is not None else pil))
        return EncodedImage(ref=ref, width=pil.width, height=pil.height, backend=self.backend)

    def _keep(self, ref: ImageRef) -> ImageRef:
        self._made.add(ref)  # callers make refs on their own threads: one set.add, under the GIL
        return ref

    def _load(self, image: Any):
        if image is None:
            raise InvalidRequest("image: is required")
        return load_image(image, max_pixels=self.max_pixels)

    def _own(self, image: EncodedImage) -> EncodedImage:
        if not image.made_by(self.backend):
            raise InvalidRequest("image: this EncodedImage was made by another engine; encode it "
                                 "with this one")
        return image

    def _check_takes(self) -> None:
        if not self.takes_images:
            raise InvalidRequest(NO_IMAGES)
