"""The app: both APIs, health and stats, behind the guard.

``create_app(engine, settings)`` builds it around any ``Engine`` (tests use
one on the fake backend); ``bubblefree serve`` builds one around a loaded
model. The app does not own the engine: closing it is the caller's. It
has no start-up or shutdown handlers, and ``serve`` runs it with uvicorn's
lifespan off: one added here needs ``cli.main`` to turn it back on.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from bubblefree.core import InvalidRequest
from bubblefree.engine import Engine, EngineStopped
from bubblefree.server import moondream_api, openai_api
from bubblefree.server.admission import Admission
from bubblefree.server.errors import (ApiError, ErrorJSON, error_json, error_response, field_of, on_api_error,
                                     on_http_error)
from bubblefree.server.flow import Served
from bubblefree.server.guard import Guard
from bubblefree.server.observe import Observer
from bubblefree.server.settings import ServerSettings
from bubblefree.server.watch import internal_error


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    admission = Admission(settings.max_live, settings.retry_after_s)
    observer = Observer(engine, admission)
    served = Served(engine, settings, admission, observer, engine.takes_images)
    app = FastAPI(title="bubblefree", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(InvalidRequest, _on_invalid)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(Exception, _on_bug)  # Starlette's error middleware, outside the guard
    app.add_middleware(Guard, settings=settings, observer=observer)
    app.include_router(moondream_api.router(served))
    app.include_router(openai_api.router(served))

    @app.get("/health")
    async def health() -> Response:
        return _health(engine, settings)

    @app.get("/v1/stats")
    async def stats() -> dict:
        return observer.stats()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(observer.prometheus(), media_type="text/plain; version=0.0.4")

    return app


def _health(engine: Engine, settings: ServerSettings) -> Response:
    """Ok while the engine runs; once it has stopped (closed, or on an error
    it names) every request would get a 503 naming it, and so does the
    probe, or a load balancer would go on sending it traffic. So does a
    decode thread that has held requests past ``stall_s`` without a step
    ending (a hung kernel or listener): its thread is alive, and every
    request would time out."""
    try:
        engine.loop.check_running()
    except EngineStopped as err:
        return error_json(503, f"engine: {err}", "engine")
    stalled = engine.loop.stalled_for()
    if stalled > settings.stall_s:
        return error_json(503, f"engine: no decode step has ended in {stalled:.0f} s with requests waiting "
                          f"(a step or a listener that does not return)", "engine")
    return JSONResponse({"status": "ok", "model": settings.model_name})


async def _on_invalid(request: Request, err: InvalidRequest) -> ErrorJSON:
    return error_json(422, str(err), field_of(str(err)))


async def _on_bug(request: Request, err: Exception) -> ErrorJSON:
    """A bug in a route, in the one JSON shape (the traceback goes to the log).

    Starlette raises the error again once this answer is sent, and uvicorn
    then closes the connection: a client that kept it alive would send its
    next request into a reset. ``Connection: close`` tells it to open a new one.
    """
    return error_response(internal_error(err))


async def _on_validation(request: Request, err: RequestValidationError) -> ErrorJSON:
    first = err.errors()[0] if err.errors() else {}
    field = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
    return error_json(422, f"{field}: {first.get('msg', 'invalid')}", field)
