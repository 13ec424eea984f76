"""Moondream's routes, taking exactly what its Python client sends.

The client posts JSON to ``{endpoint}/query`` and friends with the image as
an ``image_url`` data URI, ``settings`` holding ``temperature``, ``top_p``,
``max_tokens`` (and ``max_objects`` for point and detect), and ``stream``.
A stream is server-sent events: ``data: {"chunk": "..."}`` lines, read until
one says ``"completed": true``.

An image model (moondream2) answers every route about the image; ``query``
also without one. A text model answers ``query`` and ``caption`` without an
image; an image, or a spatial skill (which needs one), is refused naming
``image_url``. point, detect and segment answer whole, not streamed.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bubblefree.core import ImageRef
from bubblefree.engine import RequestFailed
from bubblefree.server import flow
from bubblefree.server.body import Fields, read_json, sampling_params, sampling_values
from bubblefree.server.errors import ApiError, error_body
from bubblefree.server.flow import ClientGone, Served, fills_context
from bubblefree.server.images import read_image
from bubblefree.server.runs import Run, run_skill

# The engine's field names, and the client's.
NAMES = {"max_tokens": "settings.max_tokens", "max_objects": "settings.max_objects", "image": "image_url"}
# The client's field the engine's "prompt" was made from, by skill.
PROMPTS = {"query": "question", "point": "object", "detect": "object", "segment": "object"}
TEXT_SKILLS = ("query", "caption")  # what a model answers without an image
RESULT = {"query": ("answer",), "caption": ("caption",), "point": ("points",), "detect": ("objects",),
          "segment": ("path", "bbox")}


def router(served: Served) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.post("/query")
    async def query(request: Request) -> Response:
        body = await read_json(request, served.settings.max_json_values)
        question = body.text("question")
        _no_reasoning(body)
        return await _skill(served, request, body, "query", {"question": question})

    @api.post("/caption")
    async def caption(request: Request) -> Response:
        body = await read_json(request, served.settings.max_json_values)
        length = body.text("length", "normal")
        return await _skill(served, request, body, "caption", {"length": length})

    for skill in ("point", "detect", "segment"):
        api.add_api_route(f"/{skill}", _spatial(served, skill), methods=["POST"])
    return api


def _spatial(served: Served, skill: str):
    async def route(request: Request) -> Response:
        body = await read_json(request, served.settings.max_json_values)
        obj = body.text("object")
        if body.flag("stream"):
            raise body.refuse("stream", f"{skill} answers whole; ask without stream")
        return await _skill(served, request, body, skill, {"object": obj})
    route.__name__ = skill
    return route


async def _skill(served: Served, request: Request, body: Fields, skill: str, args: dict[str, Any]) -> Response:
    image = body.raw("image_url")
    stream = body.flag("stream")
    body.text("model", None)  # one model per server: any name is this one
    refs = body.raw("spatial_refs")
    if refs not in (None, Fields.MISSING):
        if skill != "query":  # moondream2's reference reads them in query alone
            raise body.refuse("spatial_refs", f"{skill} takes none; query refers to points and boxes")
        args = {**args, "spatial_refs": refs}  # the skill checks them, naming the reference
    args = {**args, **_settings(body, spatial=skill in ("point", "detect"))}
    body.done()
    if served.takes_images:  # a skill the model does not serve is named as such, not as a missing image
        served.engine.skills.tables(skill)
    has_image = _has_image(served, skill, image)
    names = dict(_names(served, skill, None))  # begin() renames for the image, once it is read

    async def begin() -> Run:
        # The image is read once admitted, as the OpenAI routes read theirs:
        # past the live bound a request is refused at once, not after decoding
        # (seconds, in the shared worker pool, for an image of tens of megapixels).
        # A bad image raises here, and flow.start frees the admission slot.
        if not has_image:
            return await run_skill(served.engine, skill, **args)
        ref = await read_image(served, image, "image_url")
        names.update(_names(served, skill, ref))
        return await run_skill(served.engine, skill, **args, image=ref)

    if stream:
        run, ticket = await flow.start(served, begin, names)
        return flow.stream(served, run, ticket, _chunks(run), lambda err: [_failure(err)])
    try:
        done = await flow.complete(served, request, begin, names=names)
    except ClientGone:
        return flow.gone()
    output = done.run.handle.output(0)
    return JSONResponse({**{key: output[key] for key in RESULT[skill]},
                         "request_id": str(done.run.handle.request_id)})


def _has_image(served: Served, skill: str, image: Any) -> bool:
    """Whether the request brings an image to read; the refusals that need
    no decoding, made before admission. A skill that needs an image is
    refused on a text model before the image is read: the answer is the same
    whatever the image, and "ask without one" sent the caller on to a second
    refusal."""
    if skill not in TEXT_SKILLS and not served.takes_images:
        raise ApiError(422, f"image_url: {skill} needs an image, and this model takes no images; "
                       "it answers query and caption as text", "image_url")
    if image is Fields.MISSING or image is None:
        if skill not in TEXT_SKILLS:
            raise ApiError(422, "image_url: is required", "image_url")
        return False
    return True


def _names(served: Served, skill: str, image: ImageRef | None) -> dict[str, str]:
    """The engine's field names as the client's. A prompt too long for the
    context is the client's text (``question``, ``object``), unless the
    image leaves no room for even one token of prompt: a vision-language
    model's image grows with its size (Qwen2-VL's), and then no text is short
    enough. A caption's prompt is the model's own words: its image is what
    is too long."""
    text = PROMPTS.get(skill)
    if image is not None and (text is None or fills_context(served.engine, image)):
        text = "image_url"
    return {**NAMES, "prompt": text} if text else NAMES


async def _chunks(run: Run) -> AsyncIterator[dict]:
    try:
        async for piece in run.pieces:
            yield {"chunk": piece, "completed": False}
    except RequestFailed as err:
        yield _failure(flow.failure(err))
        return
    yield {"chunk": "", "completed": True}


def _failure(err: ApiError) -> dict:
    return {**error_body(err.status, err.message, err.param), "completed": True}


def _settings(body: Fields, spatial: bool) -> dict[str, Any]:
    """``settings`` as the engine's keywords: ``max_tokens``, ``sampling``,
    and for point and detect ``max_objects``."""
    settings = body.nested("settings")
    if settings is None:
        return {}
    values = sampling_values(settings)
    out: dict[str, Any] = {"max_tokens": settings.integer("max_tokens", 1)}
    if spatial:
        out["max_objects"] = settings.integer("max_objects", 1)
    settings.done()
    out["sampling"] = sampling_params(values, "settings.")
    return {k: v for k, v in out.items() if v is not None}


def _no_reasoning(body: Fields) -> None:
    if body.flag("reasoning"):
        raise body.refuse("reasoning", "not supported by this model")
