"""OpenAI's routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, in the shapes its Python client parses.

A conversation becomes one prompt (the model's chat template where it has
one; moondream's query template on moondream2, with the conversation's
image); a completion's prompt is encoded as it is, or taken as the token
ids it is (an array of integers, as OpenAI's takes them). Streams are
server-sent events, ``data: {chunk}`` lines closed by ``data: [DONE]``.
``stop`` strings end the answer where one appears, trimmed off, streamed
or not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bubblefree.core import ImageRef, InvalidRequest
from bubblefree.engine import RequestFailed
from bubblefree.server import flow
from bubblefree.server.body import Fields, each_object, read_json, sampling_params, sampling_values, valid_text
from bubblefree.server.errors import ApiError, error_body, field_of
from bubblefree.server.flow import ClientGone, Served, fills_context
from bubblefree.server.images import read_image
from bubblefree.server.runs import Run, chat_prompt, finish_reason, run_prompt
from bubblefree.server.stops import MAX_STOP_CHARS, StopText

ROLES = ("system", "developer", "user", "assistant")
# Newer OpenAI clients send their instructions as "developer": to a chat
# template, which knows no such role, they are the system turn.
AS_ROLE = {"developer": "system"}


@attrs.frozen
class Ask:
    """A checked request of either kind."""

    prompt: list[int]
    max_tokens: int | None
    sampling: Any
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    image: ImageRef | None = None  # the conversation's image, on a model that takes one
    max_tokens_field: str = "max_tokens"  # the field the client gave it in, for a refusal to name
    image_field: str | None = None  # the image part that held the image, likewise


def router(served: Served) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model(served)]}

    @api.get("/models/{name:path}")
    async def model(name: str) -> dict:
        if name != served.settings.model_name:
            raise ApiError(404, f"model: no model {name!r}; this server serves "
                                f"{served.settings.model_name!r}", "model")
        return _model(served)

    @api.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body = await read_json(request, served.settings.max_json_values)
        images: list[tuple[str, Any]] = []
        messages, image_in = _messages(body, images)
        ask = _ask(body, [])
        if len(images) > 1:
            where = images[1][0]
            raise ApiError(422, f"{where}: one image a request; this is the second", where)

        async def ready() -> Ask:
            # Off the event loop, as every tokenization here: a prompt of megabytes
            # (or a hundred thousand messages) takes seconds, and would hold up every client.
            prompt = await asyncio.to_thread(_chat_ids, served.engine.skills.tokenizer, messages, image_in)
            image = await read_image(served, images[0][1], images[0][0]) if images else None
            return attrs.evolve(ask, prompt=prompt, image=image, image_field=images[0][0] if images else None)
        return await _answer(served, request, ask, ready, "chat.completion", _chat_choice)

    @api.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, served.settings.max_json_values)
        prompt = body.raw("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if _token_ids(prompt):  # as OpenAI's and vLLM's take them; the engine checks each id
            ask = _ask(body, list(prompt))
            return await _answer(served, request, ask, _ready(ask), "text_completion", _text_choice)
        if not isinstance(prompt, str) or not prompt:
            raise body.refuse("prompt", "must be a non-empty string or array of token ids "
                                        "(one prompt a request)")
        valid_text(prompt, "prompt")
        ask = _ask(body, [])

        async def ready() -> Ask:
            ids = await asyncio.to_thread(served.engine.skills.tokenizer.encode, prompt)
            if not ids:
                raise ApiError(422, "prompt: holds no token once tokenized (this model's tokenizer "
                                    f"reads nothing in {prompt[:40]!r})", "prompt")
            return attrs.evolve(ask, prompt=ids)
        return await _answer(served, request, ask, ready, "text_completion", _text_choice)

    return api


def _token_ids(prompt: Any) -> bool:
    """Whether ``prompt`` is a non-empty array of integers: token ids, not
    text (a bool is no id; ``Engine.submit`` refuses any outside the vocabulary)."""
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def _ready(ask: Ask) -> Callable[[], Awaitable[Ask]]:
    async def ready() -> Ask:
        return ask
    return ready


def _messages(body: Fields, images: list[tuple[str, Any]]) -> tuple[list[tuple[str, str]], int | None]:
    """The conversation as (role, text), and the index of the message with
    the first image (None without one); each image part's (field, url) goes
    to ``images``, checked once the rest of the body is."""
    messages = body.items("messages")
    if not messages:
        raise body.refuse("messages", "must hold at least one message")
    out, image_in = [], None
    for where, fields in each_object(messages, "messages"):
        role = fields.text("role")
        if role not in ROLES:
            raise fields.refuse("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        content = fields.raw("content")
        fields.text("name", None)
        fields.done()
        had = len(images)
        out.append((AS_ROLE.get(role, role), _content(content, where, images)))
        if image_in is None and len(images) > had:
            image_in = len(out) - 1
    return out, image_in


def _chat_ids(tokenizer: Any, messages: list[tuple[str, str]], image_in: int | None) -> list[int]:
    """The conversation's prompt ids (a message spelling a special token is
    refused naming it); the template's other refusals of its ``prompt``, a
    field a chat client never sent, name the conversation."""
    try:
        return chat_prompt(tokenizer, messages, image_in)
    except InvalidRequest as err:
        message = str(err)
        if field_of(message) != "prompt":
            raise
        raise ApiError(422, "messages" + message[len("prompt"):], "messages") from None


def _content(content: Any, where: str, images: list[tuple[str, Any]]) -> str:
    if isinstance(content, str):
        return valid_text(content, f"{where}.content")
    if not isinstance(content, list):
        raise ApiError(422, f"{where}.content: must be a string or an array of parts", f"{where}.content")
    texts = []
    for at, fields in each_object(content, f"{where}.content"):
        kind = fields.text("type")
        if kind == "text":
            texts.append(valid_text(fields.text("text"), fields.name("text")))
            fields.done()
        elif kind == "image_url":
            image = fields.nested("image_url")
            url = image.raw("url") if image is not None else None
            if image is not None:
                image.text("detail", None)  # OpenAI's resolution hint: the model sees the image as it is
                image.done()
            fields.done()
            images.append((f"{at}.image_url.url", url))
        else:
            raise fields.refuse("type", f"must be text or image_url, got {kind!r}")
    return "\n".join(texts)  # as vLLM joins them: "what is" and "the sky" are not "what isthe sky"


def _ask(body: Fields, prompt: list[int]) -> Ask:
    body.text("model", None)  # one model per server: any name is this one
    body.text("user", None)
    max_tokens = body.integer("max_tokens", 1)
    newer = body.integer("max_completion_tokens", 1)
    max_tokens, max_tokens_field = (newer, "max_completion_tokens") if newer is not None \
        else (max_tokens, "max_tokens")
    n = body.integer("n", 1, 1)
    if n != 1:
        raise body.refuse("n", f"this server gives one choice a request, got {n}")
    values = sampling_values(body)  # top_k and min_p as vLLM's server takes them
    stops = _stops(body)
    _neutral(body)
    stream = body.flag("stream")
    options = body.nested("stream_options")
    if options is not None and not stream:  # as OpenAI refuses it: a client expecting usage would get none
        raise body.refuse("stream_options", "only with stream: true")
    include_usage = options.flag("include_usage") if options is not None else False
    if options is not None:
        options.done()
    body.done()
    return Ask(prompt, max_tokens, sampling_params(values, ""), stops, stream, include_usage,
               max_tokens_field=max_tokens_field)


def _neutral(body: Fields) -> None:
    """Fields some clients send on every request at values that change
    nothing: taken absent, null or at those values, refused naming them at
    any other (this server applies no penalty, gives no log probabilities,
    stores nothing, calls no tools; a completions request's ``logprobs`` is
    a count)."""
    for field, (holds, words) in _NEUTRAL.items():
        value = body.raw(field)
        if value is not Fields.MISSING and value is not None and not holds(value):
            raise body.refuse(field, f"{words}, got {value!r:.40}")


def _zero(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0


_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (_zero, "this server applies no penalty: only 0"),
    "frequency_penalty": (_zero, "this server applies no penalty: only 0"),
    "logprobs": (lambda v: v is False or (type(v) is int and v == 0),
                 "this server gives no log probabilities: only false (0 on completions)"),
    "top_logprobs": (lambda v: type(v) is int and v == 0, "this server gives no log probabilities: only 0"),
    "response_format": (lambda v: v == {"type": "text"}, 'this server answers in text: only {"type": "text"}'),
    "echo": (lambda v: v is False, "this server does not echo the prompt: only false"),
    "suffix": (lambda v: v == "", "this server takes no suffix: only an empty one"),
    "best_of": (lambda v: type(v) is int and v == 1, "this server gives one choice a request: only 1"),
    "store": (lambda v: v is False, "this server stores no answers: only false"),
    "metadata": (lambda v: v == {}, "this server stores no answers: only an empty object"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "only true or false (this server calls no tools)"),
    # Moondream's client sends it on chat (``reasoning=False``), as /v1/query takes it.
    "reasoning": (lambda v: v is False, "not supported by this model: only false"),
}


def _stops(body: Fields) -> tuple[str, ...]:
    stop = body.raw("stop")
    if stop is Fields.MISSING or stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(
            isinstance(s, str) and s for s in stops):
        raise body.refuse("stop", "must be a non-empty string or an array of 1 to 4 of them")
    if max(map(len, stops)) > MAX_STOP_CHARS:
        raise body.refuse("stop", f"each must be at most {MAX_STOP_CHARS} characters, got one of "
                          f"{max(map(len, stops))}")
    return tuple(stops)


Choice = Callable[[str, str | None, bool], dict]


def _chat_choice(text: str, reason: str | None, delta: bool) -> dict:
    key = "delta" if delta else "message"
    content = {"content": text} if delta else {"role": "assistant", "content": text}
    return {"index": 0, key: content, "finish_reason": reason, "logprobs": None}


def _text_choice(text: str, reason: str | None, delta: bool) -> dict:
    return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}


async def _answer(served: Served, request: Request, ask: Ask, ready: Callable[[], Awaitable[Ask]],
                  kind: str, choice: Choice) -> Response:
    """``ready()``: ``ask`` with its prompt tokenized and its image read,
    once the request is admitted: past the live bound a request is refused
    at once, before that work (seconds, for a prompt of megabytes)."""
    # The engine's "prompt" is the conversation here, which the client sent as
    # messages; its max_tokens may have come as max_completion_tokens.
    names = {"prompt": "messages"} if kind == "chat.completion" else {}
    names["max_tokens"] = ask.max_tokens_field

    async def begin() -> Run:
        made = await ready()
        if made.image_field is not None:
            names["image"] = made.image_field
            if fills_context(served.engine, made.image):  # no text is short enough: the image is too long
                names["prompt"] = made.image_field
        return await run_prompt(served.engine, made.prompt, made.max_tokens, made.sampling, image=made.image)

    if ask.stream:
        run, ticket = await flow.start(served, begin, names)
        head = _head(kind + (".chunk" if kind == "chat.completion" else ""), served)
        return flow.stream(served, run, ticket, _chunks(run, ask, head, choice),
                           lambda err: [error_body(err.status, err.message, err.param), "[DONE]"])
    try:
        done = await flow.complete(served, request, begin, ask.stops, names)
    except ClientGone:
        return flow.gone()
    return JSONResponse({**_head(kind, served),
                         "choices": [choice(done.text, finish_reason(done.run, done.stopped), False)],
                         "usage": _usage(done.run)})


async def _chunks(run: Run, ask: Ask, head: dict, choice: Choice) -> AsyncIterator[Any]:
    stop = StopText(ask.stops)
    if choice is _chat_choice:  # the first chunk names the role, as OpenAI's does
        yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None, "logprobs": None}]}
    try:
        async for piece in run.pieces:
            text = stop.push(piece)
            if text:
                yield {**head, "choices": [choice(text, None, True)]}
            if stop.stopped:
                run.stop_seen()
                break
    except RequestFailed as err:
        failed = flow.failure(err)
        yield error_body(failed.status, failed.message, failed.param)
        yield "[DONE]"
        return
    finally:
        await run.pieces.aclose()  # type: ignore[attr-defined]  # a stop cancels the rest
    if tail := stop.flush():
        yield {**head, "choices": [choice(tail, None, True)]}
    last = choice("", finish_reason(run, stop.stopped), True)
    if "delta" in last:
        last["delta"] = {}  # as OpenAI ends a chat stream: the reason, and nothing more said
    yield {**head, "choices": [last]}
    if ask.include_usage:
        yield {**head, "choices": [], "usage": _usage(run)}
    yield "[DONE]"


def _model(served: Served) -> dict:
    return {"id": served.settings.model_name, "object": "model", "created": 0, "owned_by": "bubblefree"}


def _head(kind: str, served: Served) -> dict:
    # Random, not the engine's request id: that restarts at 0 with every
    # engine, so replicas behind one address (or one server restarted)
    # handed different answers the same id.
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": served.settings.model_name}


def _usage(run: Run) -> dict:
    prompt, completion = run.prompt_tokens, run.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
