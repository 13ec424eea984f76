"""Moondream's routes, taking exactly what its Python client sends.

The client posts JSON to ``{endpoint}/query`` and friends with the image as
an ``image_url`` data URI, ``settings`` holding ``temperature``, ``top_p``,
``max_tokens`` (and ``max_objects`` for point and detect), and ``stream``.
A stream is server-sent events: ``data: {"chunk": "..."}`` lines, read until
one says ``"completed": true``.

A text model answers ``query`` and ``caption`` without an image; an image,
or a spatial skill (which needs one), is refused naming ``image_url``.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bubblefree.engine import RequestFailed
from bubblefree.server import flow
from bubblefree.server.body import Fields, read_json, sampling_params
from bubblefree.server.errors import ApiError, error_body
from bubblefree.server.flow import ClientGone, Served
from bubblefree.server.images import check_image
from bubblefree.server.runs import Run, run_skill

SETTINGS_NAMES = {"max_tokens": "settings.max_tokens"}  # the engine's name, and the client's


def router(served: Served) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.post("/query")
    async def query(request: Request) -> Response:
        body = await read_json(request)
        question = body.text("question")
        _no_reasoning(body)
        return await _text_skill(served, request, body, "query", {"question": question}, "answer")

    @api.post("/caption")
    async def caption(request: Request) -> Response:
        body = await read_json(request)
        length = body.text("length", "normal")
        return await _text_skill(served, request, body, "caption", {"length": length}, "caption")

    for skill in ("point", "detect", "segment"):
        api.add_api_route(f"/{skill}", _spatial(served, skill), methods=["POST"])
    return api


async def _text_skill(served: Served, request: Request, body: Fields, skill: str,
                      args: dict[str, Any], key: str) -> Response:
    image = body.raw("image_url")
    stream = body.flag("stream")
    body.text("model", None)  # one model per server: any name is this one
    if body.raw("spatial_refs") not in (None, Fields.MISSING):
        raise body.refuse("spatial_refs", "not supported by this server")
    max_tokens, sampling = _settings(body, spatial=False)
    body.done()
    if image is not None and image is not Fields.MISSING:
        check_image(image, "image_url", served.takes_images, served.settings.max_image_pixels)

    def begin() -> Run:
        return run_skill(served.engine, skill, max_tokens=max_tokens, sampling=sampling, **args)

    if stream:
        run, ticket = flow.start(served, begin, SETTINGS_NAMES)
        return flow.stream(served, run, ticket, _chunks(run),
                           lambda: [_failure(504, f"request: not finished within "
                                                  f"{served.settings.request_timeout_s:g} s; cancelled")])
    try:
        done = await flow.complete(served, request, begin, names=SETTINGS_NAMES)
    except ClientGone:
        return flow.gone()
    return JSONResponse({key: done.run.handle.output(0)[key], "request_id": str(done.run.handle.request_id)})


async def _chunks(run: Run) -> AsyncIterator[dict]:
    try:
        async for piece in run.pieces:
            yield {"chunk": piece, "completed": False}
    except RequestFailed as err:
        yield _failure(500, f"request: {err.result.finish_reason}")
        return
    yield {"chunk": "", "completed": True}


def _failure(status: int, message: str) -> dict:
    return {**error_body(status, message, "request"), "completed": True}


def _spatial(served: Served, skill: str):
    async def route(request: Request) -> Response:
        body = await read_json(request)
        image = body.raw("image_url")
        body.text("object")
        body.text("model", None)
        body.raw("spatial_refs")
        body.flag("stream")
        _settings(body, spatial=skill != "segment")
        body.done()
        if image is Fields.MISSING or image is None:
            if not served.takes_images:
                raise ApiError(422, f"image_url: {skill} needs an image, and this model takes no "
                               "images; it answers query and caption as text", "image_url")
            raise ApiError(422, "image_url: is required", "image_url")
        check_image(image, "image_url", served.takes_images, served.settings.max_image_pixels)
        # Reached only by a model that takes images, which the engine cannot run yet.
        raise ApiError(501, f"{skill}: images are not served yet", "image_url")
    route.__name__ = skill
    return route


def _settings(body: Fields, spatial: bool) -> tuple[int | None, Any]:
    settings = body.nested("settings")
    if settings is None:
        return None, None
    values = {k: v for k in ("temperature", "top_p") if (v := settings.number(k)) is not None}
    seed = settings.integer("seed", 0)
    if seed is not None:
        values["seed"] = seed
    max_tokens = settings.integer("max_tokens", 1)
    if spatial:
        settings.integer("max_objects", 1)
    settings.done()
    return max_tokens, sampling_params(values, "settings.")


def _no_reasoning(body: Fields) -> None:
    if body.flag("reasoning"):
        raise body.refuse("reasoning", "not supported by this model")
