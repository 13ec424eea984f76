"""One generation request's life, shared by both APIs: admitted (or 429),
submitted (an ``InvalidRequest`` is a 422 naming its field), then read to
the end or streamed, raced against the client leaving and the deadline.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
from starlette.requests import Request
from starlette.responses import Response

from bubblefree.core import InvalidRequest, Status
from bubblefree.engine import Engine, EngineStopped, RequestFailed
from bubblefree.server.admission import Admission, Ticket
from bubblefree.server.errors import ApiError, field_of
from bubblefree.server.observe import Observer
from bubblefree.server.runs import Run
from bubblefree.server.settings import ServerSettings
from bubblefree.server.stops import StopText
from bubblefree.server.watch import ClientGone, EventStream, watched


@attrs.define
class Served:
    engine: Engine
    settings: ServerSettings
    admission: Admission
    observer: Observer
    takes_images: bool = False


@attrs.define
class Text:
    run: Run
    text: str
    stopped: bool  # a stop string ended it


def fills_context(engine: Engine, image: Any) -> bool:
    """Whether ``image`` (an ``ImageRef``) leaves no room for even one token
    of prompt: a refusal of the prompt as too long then names the image, as
    no text is short enough (a vision-language model's image grows with its
    size, Qwen2-VL's)."""
    room = engine.output_room(image.length + 1)
    return room is not None and room < 1


async def start(served: Served, begin: Callable[[], Awaitable[Run]],
                names: dict[str, str] | None = None) -> tuple[Run, Ticket]:
    """Admit and submit. ``names`` maps the engine's field names to the
    client's (Moondream's ``max_tokens`` sits in ``settings``)."""
    ticket = served.admission.enter()
    try:
        return await begin(), ticket
    except InvalidRequest as err:
        ticket.leave()
        message, field = str(err), field_of(str(err))
        if field in (names or {}):
            message, field = names[field] + message[len(field):], names[field]
        raise ApiError(422, message, field) from None
    except EngineStopped as err:
        ticket.leave()
        raise ApiError(503, f"engine: {err}", "engine", headers={"Retry-After": "1"}) from None
    except BaseException:
        ticket.leave()
        raise


async def complete(served: Served, request: Request, begin: Callable[[], Awaitable[Run]],
                   stops: tuple[str, ...] = (), names: dict[str, str] | None = None) -> Text:
    """Run to the end and return the text. Raises ``ClientGone`` if the client
    left (the request is cancelled), 504 past the deadline."""
    run, ticket = await start(served, begin, names)
    try:
        return await watched(request.receive, _collect(run, stops), served.settings.request_timeout_s)
    finally:
        ticket.leave()
        served.observer.tokens(run.prompt_tokens, run.completion_tokens)


async def _collect(run: Run, stops: tuple[str, ...]) -> Text:
    stop, parts = StopText(stops), []
    try:
        async for piece in run.pieces:
            parts.append(stop.push(piece))
            if stop.stopped:
                run.stop_seen()
                break
    except RequestFailed as err:
        raise failure(err) from None
    finally:
        await run.pieces.aclose()  # type: ignore[attr-defined]  # a stop cancels the rest
    parts.append(stop.flush())
    return Text(run, "".join(parts), stop.stopped)


def stream(served: Served, run: Run, ticket: Ticket, events: AsyncIterator[Any],
           ending: Callable[[ApiError], list[Any]]) -> EventStream:
    """``ending``: the API's last events for a stream the deadline (504) or
    the server's shutdown (503) ends."""
    def on_end(how: str) -> None:
        ticket.leave()
        if not run.handle.done:
            run.handle.cancel()
        served.observer.tokens(run.prompt_tokens, run.completion_tokens)
        served.observer.stream_ended(how)
    return EventStream(events, served.settings.request_timeout_s, ending, on_end)


def failure(err: RequestFailed) -> ApiError:
    """A request that ended without completing, as the client's error: a
    503 if it was cancelled (the server cancels only for a client that
    left, the deadline or a stop string, which never get here: so the
    engine closed under it), else a 500 with the reason."""
    if err.result.status is Status.CANCELLED:
        return ApiError(503, f"engine: stopping; the request was cancelled before it ended "
                             f"({err.result.finish_reason})", "engine", headers={"Retry-After": "1"})
    return ApiError(500, f"request: {err.result.finish_reason}", "request")


def gone() -> Response:
    """The answer to a client that left: nobody reads it; the count records it."""
    return Response(status_code=499)


__all__ = ["ClientGone", "Served", "Text", "complete", "failure", "gone", "start", "stream"]
