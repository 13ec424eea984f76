"""The skills as moondream's client spells them, image first.

    engine.caption(image, length="normal", stream=False, settings=None)  -> {"caption": str}
    engine.query(image=None, question=..., stream=False, settings=None,
                 spatial_refs=None)                                      -> {"answer": str}
    engine.point(image, object, settings=None)                           -> {"points": [{"x", "y"}]}
    engine.detect(image, object, settings=None)                          -> {"objects": [{"x_min", ...}]}
    engine.segment(image, object, settings=None)                         -> {"path", "bbox"}
    engine.encode_image(image)                                           -> EncodedImage

``image`` is a PIL image, a path, bytes, a numpy array or an
``EncodedImage``; it is read and checked on the caller's thread (the asyncio
forms: in a worker thread). ``stream=True`` gives ``{"answer": iterator}``
(``{"caption": ...}``) of text pieces. ``settings`` is moondream's:
``temperature``, ``top_p``, ``max_tokens``, ``max_objects`` (point,
detect), and our ``top_k``, ``min_p`` and ``seed``; the engine's own
keywords (``max_tokens``, ``sampling``, ``max_objects``, ``listener``) are
accepted too. Coordinates
are normalized to the image, origin top left; so are ``spatial_refs``,
points ``[x, y]`` and boxes ``[x_min, y_min, x_max, y_max]`` a question
refers to (models whose config names the placeholders; ``skills.spatial_refs``).

The calls of a text model keep their keyword forms and their first
positional meaning: ``query("What is...")`` is a question, ``point("the
cat")`` an object, and on a model that takes no images ``caption("short")``
a length. Every a-prefixed form (``aquery``...) is the asyncio one.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from bubblefree.core import ImageRef, InvalidRequest, SamplingParams
from bubblefree.core.values import SAMPLING_FIELDS, named, shown
from bubblefree.encoded import EncodedImage
from bubblefree.skills.text import CAPTION_LENGTHS

SETTINGS = (*SAMPLING_FIELDS, "max_tokens", "max_objects")
OBJECT_SKILLS = ("point", "detect")


def _shift(image: Any, text: Any) -> tuple[Any, Any]:
    """``f("words")`` with no second argument: the words are the text."""
    if text is None and isinstance(image, str):
        return None, image
    return image, text


def call_args(skill: str, image: Any, settings: Any, kw: dict[str, Any], **args: Any) -> dict[str, Any]:
    """One call's arguments for ``Engine.submit``: ``settings`` folded into
    the engine's keywords (a value given both ways is refused, naming it)."""
    out = {k: v for k, v in args.items() if v is not None}
    out.update(kw)
    if image is not None:
        out["image"] = image
    if settings is None:
        return out
    if not isinstance(settings, Mapping):
        raise InvalidRequest(f"settings: must be a mapping, got {type(settings).__name__}")
    allowed = SETTINGS if skill in OBJECT_SKILLS else SETTINGS[:-1]
    unknown = sorted(named(k) for k in settings if k not in allowed)
    if unknown:
        raise InvalidRequest(f"settings.{unknown[0]}: unknown; expected {', '.join(allowed)}")
    sampling = {k: settings[k] for k in SAMPLING_FIELDS if k in settings}
    if sampling:
        if out.get("sampling") is not None:
            raise InvalidRequest("settings: sampling values given both in settings and as sampling=")
        try:
            out["sampling"] = SamplingParams.of(sampling)
        except InvalidRequest as err:  # named as the caller spelled it
            raise InvalidRequest(str(err).replace("sampling.", "settings.", 1)) from None
    for key in ("max_tokens", "max_objects"):
        if key in settings:
            if out.get(key) is not None:
                raise InvalidRequest(f"settings.{key}: given twice (also as {key}=)")
            out[key] = settings[key]
    return out


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name}: must be True or False, got {shown(value)}")
    return value


class SkillCalls:
    """Mixed into ``bubblefree.Engine``: the calls above on its ``run``,
    ``stream``, ``arun`` and ``astream``."""

    # ----------------------------------------------------------- blocking
    def caption(self, image: Any = None, length: str | None = None, stream: bool = False,
                settings: Mapping | None = None, **kw: Any) -> dict:
        image, length = self._caption_args(image, length)
        return self._text("caption", "caption", stream, call_args("caption", image, settings, kw, length=length))

    def query(self, image: Any = None, question: str | None = None, stream: bool = False,
              settings: Mapping | None = None, spatial_refs: Any = None, **kw: Any) -> dict:
        image, question = _shift(image, question)
        return self._text("query", "answer", stream, call_args("query", image, settings, kw, question=question,
                                                                spatial_refs=spatial_refs))

    def point(self, image: Any = None, object: str | None = None,  # noqa: A002 - moondream's name
              settings: Mapping | None = None, **kw: Any) -> dict:
        image, object = _shift(image, object)
        return self.run("point", **call_args("point", image, settings, kw, object=object))

    def detect(self, image: Any = None, object: str | None = None,  # noqa: A002
               settings: Mapping | None = None, **kw: Any) -> dict:
        image, object = _shift(image, object)
        return self.run("detect", **call_args("detect", image, settings, kw, object=object))

    def segment(self, image: Any = None, object: str | None = None,  # noqa: A002
                settings: Mapping | None = None, **kw: Any) -> dict:
        image, object = _shift(image, object)
        return self.run("segment", **call_args("segment", image, settings, kw, object=object))

    def encode_image(self, image: Any) -> EncodedImage:
        """Read and check ``image`` once; pass the result in its place to ask
        many questions of it. ``EngineStopped`` once the engine is closed."""
        self.loop.check_running()
        return self.images.encode(image)

    def stream_query(self, question: str, **kw: Any):
        return self.stream("query", question=question, **kw)

    def _text(self, skill: str, key: str, stream: bool, args: dict[str, Any]) -> dict:
        if _flag("stream", stream):
            return {key: self.stream(skill, **args)}
        return self.run(skill, **args)

    def _caption_args(self, image: Any, length: str | None) -> tuple[Any, str | None]:
        # A text model takes no image, so a word first is the length (its old
        # call, caption("short")); on any model a length word is one.
        if length is None and isinstance(image, str) and (
                image in CAPTION_LENGTHS or not self.images.takes_images):
            return None, image
        return image, length

    # ------------------------------------------------------------ asyncio
    async def acaption(self, image: Any = None, length: str | None = None, stream: bool = False,
                       settings: Mapping | None = None, **kw: Any) -> dict:
        image, length = self._caption_args(image, length)
        args = call_args("caption", image, settings, kw, length=length)
        return await self._atext("caption", "caption", stream, args)

    async def aquery(self, image: Any = None, question: str | None = None, stream: bool = False,
                     settings: Mapping | None = None, spatial_refs: Any = None, **kw: Any) -> dict:
        image, question = _shift(image, question)
        return await self._atext("query", "answer", stream,
                                 call_args("query", image, settings, kw, question=question,
                                           spatial_refs=spatial_refs))

    async def apoint(self, image: Any = None, object: str | None = None,  # noqa: A002
                     settings: Mapping | None = None, **kw: Any) -> dict:
        image, object = _shift(image, object)
        return await self.arun("point", **call_args("point", image, settings, kw, object=object))

    async def adetect(self, image: Any = None, object: str | None = None,  # noqa: A002
                      settings: Mapping | None = None, **kw: Any) -> dict:
        image, object = _shift(image, object)
        return await self.arun("detect", **call_args("detect", image, settings, kw, object=object))

    async def asegment(self, image: Any = None, object: str | None = None,  # noqa: A002
                       settings: Mapping | None = None, **kw: Any) -> dict:
        image, object = _shift(image, object)
        return await self.arun("segment", **call_args("segment", image, settings, kw, object=object))

    async def aencode_image(self, image: Any) -> EncodedImage:
        return await asyncio.to_thread(self.encode_image, image)

    async def _atext(self, skill: str, key: str, stream: bool, args: dict[str, Any]) -> dict:
        if _flag("stream", stream):
            return {key: await self.astream_now(skill, **args)}
        return await self.arun(skill, **args)

    async def _aimage(self, skill: str, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` with its image read in a worker thread, so a large file
        never stalls the event loop; an unknown or unserved ``skill`` is
        refused first, as the blocking forms do, before the image is read."""
        image = args.get("image")
        if image is None or isinstance(image, (ImageRef, EncodedImage)):
            return args
        self.skills.tables(skill)
        return {**args, "image": await asyncio.to_thread(self.images.ref, image)}
