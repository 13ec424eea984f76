"""``bubblefree serve --replicas N``: N engines on Ray Serve behind a relay.

Two deployments. ``EngineReplica`` (N copies, one GPU each where the
cluster has GPUs) builds its own engine when it starts and runs the app
(``create_app``) on the requests handed to it. ``Relay`` is the HTTP
ingress: it refuses what the app's guard would refuse from the headers
(the API key, a ``Content-Length`` over the limit), reads a request's body
(bounded by the body limit and the body timeout, as the guard bounds it),
hands the request to a replica through Ray's handle, and relays the
answer's ASGI messages as they come, so streams stay streams.

Why a relay instead of the replicas as Ray's ingress: when a replica dies,
Ray's proxy answers its in-flight requests with a bare ``500 Internal Server
Error`` in plain text, or cuts a stream off mid-body. The relay sees the
replica's death as an exception and answers in the server's own error
shape: a ``503`` JSON error naming ``replica`` (with ``Retry-After``) when
no answer had started, else, on an event stream, a last ``error`` event
before the stream ends. A client that leaves cancels the handle's call; the
replica then tells the app the client is gone, which cancels the engine's
request and frees its pages, as it would behind one server.

Every answer a replica gives carries ``X-Bubblefree-Replica``, its id, so a
client or a test can see how the load was spread and which replica failed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message

from bubblefree.engine import Engine
from bubblefree.server.errors import ApiError, ErrorJSON, error_body, error_json, error_response
from bubblefree.server.guard import limited, refusal
from bubblefree.server.settings import ServerSettings

REPLICA_HEADER = "x-bubblefree-replica"
APP = "bubblefree"
DEPLOYMENT = "bubblefree"
RELAY = "bubblefree-relay"
# Ray's cap on a replica's requests, this far above the app's own
# (``max_live``). A request past Ray's cap waits in the relay's queue, with
# no bound and no answer; under it, the app answers a request past max_live
# with its 429 at once, and /health and /v1/stats are not held behind the
# live requests.
HEADROOM = 32
# What of an ASGI scope travels to a replica: plain values only.
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "server", "client")


def replica_id() -> str:
    from ray import serve
    context = serve.get_replica_context()
    return str(getattr(getattr(context, "replica_id", None), "unique_id", None) or context.replica_tag)


class EngineReplica:
    """One engine and its app; ``http`` runs one request through the app and
    yields the app's ASGI messages."""

    def __init__(self, make_engine: Callable[[], Engine], settings: ServerSettings):
        from bubblefree.server.app import create_app
        self.engine = make_engine()
        self.settings = settings
        self.app = create_app(self.engine, settings)
        self.tag = (REPLICA_HEADER.encode(), replica_id().encode())

    async def http(self, scope: dict, body: bytes) -> AsyncIterator[Message]:
        sent: asyncio.Queue[Message | None] = asyncio.Queue()
        left = asyncio.Event()  # the relay cancelled: its client is gone
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.tag]}
            await sent.put(message)

        async def run() -> None:
            try:
                await self.app(dict(scope, state={}), receive, send)
            finally:
                await sent.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await sent.get()) is not None:
                yield message
            await task  # the app's own exception, if it raised
        finally:
            if not task.done():
                # Cancelled by the relay: let the app see its client leave
                # (it cancels the request), then give it a moment to finish.
                left.set()
                try:
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
                except BaseException:  # noqa: BLE001 - already leaving
                    task.cancel()

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine has stopped
        (an error, or closed) raises, so Ray replaces it rather than keep
        sending it requests that can only get a 503; so does one whose decode
        thread has held requests past ``stall_s`` without a step ending."""
        self.engine.loop.check_running()
        stalled = self.engine.loop.stalled_for()
        if stalled > self.settings.stall_s:
            raise RuntimeError(f"engine: no decode step has ended in {stalled:.0f} s with requests waiting")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


class Relay:
    """The HTTP ingress: one request, relayed to one replica."""

    def __init__(self, replicas: Any, settings: ServerSettings):
        self.replicas = replicas.options(stream=True)
        self.settings = settings

    async def __call__(self, request: Request) -> Response:
        # The replica's guard would refuse these too; no need to carry them there.
        refused = refusal(request.scope, self.settings)
        if refused is not None:
            return error_response(refused)
        receive, body = limited(request.receive, self.settings), bytearray()
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":  # gone before its body was in: no replica had it
                    return Response(status_code=499)
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        except ApiError as err:  # too large (413), or too slow to arrive (408)
            return error_response(err)
        scope = {k: request.scope[k] for k in _SCOPE_KEYS if k in request.scope}
        messages = self.replicas.http.remote(scope, bytes(body))
        try:
            start = await messages.__anext__()
        except StopAsyncIteration:
            return unavailable("the replica ended the request without an answer")
        except asyncio.CancelledError:
            messages.cancel()
            raise
        except Exception as err:  # noqa: BLE001 - the replica died or could not be reached
            return unavailable(f"the replica serving this request stopped ({type(err).__name__}); retry")
        headers = dict((k.decode("latin-1"), v.decode("latin-1")) for k, v in start.get("headers", []))
        if not headers.get("content-type", "").startswith("text/event-stream"):
            return await _whole(messages, start)
        response = StreamingResponse(_bodies(messages), status_code=start["status"])
        response.raw_headers = [(k, v) for k, v in start.get("headers", [])
                                if k.lower() != b"content-length"]
        return response


async def _whole(messages: Any, start: Message) -> Response:
    """A JSON answer, gathered whole before anything is sent: complete, or a
    503 naming the replica when it died part way (never a body cut short).
    Sent as one plain response: a streamed one would also listen for the
    client's disconnect on Ray Serve's receive channel, whose cancellation
    at the end of the answer Ray logs as a traceback."""
    body, done = bytearray(), False
    try:
        async for message in messages:
            if message["type"] == "http.response.body":
                body += message.get("body", b"")
                done = not message.get("more_body", False)
    except asyncio.CancelledError:  # the client left: the replica stops its request
        messages.cancel()
        raise
    except Exception as err:  # noqa: BLE001 - the replica died or its code raised mid-answer
        # An answer already whole stands: Starlette's error middleware sends
        # a route's bug as the JSON 500, then raises it again.
        if not done:
            status, message, param = failure(err)
            return error_json(status, message, param,
                              {"Retry-After": "1"} if status == 503 else None)
    response = Response(bytes(body), status_code=start["status"])
    response.raw_headers = list(start.get("headers", []))
    return response


async def _bodies(messages: Any) -> AsyncIterator[bytes]:
    """A streamed answer's events; an error event when the replica dies
    part way."""
    try:
        async for message in messages:
            if message["type"] == "http.response.body" and message.get("body"):
                yield message["body"]
    except asyncio.CancelledError:
        raise
    except Exception as err:  # noqa: BLE001 - the replica died or its code raised mid-answer
        event = error_body(*failure(err))
        yield f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    finally:
        messages.cancel()  # a no-op once the answer is complete; else the client left


def failure(err: Exception) -> tuple[int, str, str]:
    """What to tell a client whose answer broke off with ``err``: its status,
    message and field. The replica's own code raising (Ray hands it on as a
    ``RayTaskError``) is a bug, a 500 as one server words it; anything else
    (the actor died, or could not be reached) is the replica gone, a 503
    worth a retry."""
    from ray.exceptions import RayTaskError

    if isinstance(err, RayTaskError):
        cause = type(err.cause).__name__ if err.cause is not None else type(err).__name__
        return 500, f"server: an internal error ({cause}); the request did not complete", "server"
    return (503, f"replica: the replica serving this request stopped ({type(err).__name__}) "
                 "before the end; retry", "replica")


def unavailable(why: str) -> ErrorJSON:
    return error_json(503, f"replica: {why}", "replica", {"Retry-After": "1"})


def application(make_engine: Callable[[], Engine], settings: ServerSettings, replicas: int, *,
                gpus: bool, health_check_period_s: float = 2.0, log_level: str = "info",
                grace_s: float = 5.0) -> Any:
    """The Ray Serve application: the relay in front of ``replicas`` engine
    replicas, each around ``make_engine()``, one GPU each if ``gpus``.
    ``serve.run`` it; ``stop()`` ends it. ``log_level`` is the server's: Ray
    Serve's per-request access log (two lines a request, relay and replica)
    only at ``info`` or ``debug``, as uvicorn's. ``grace_s``: how long a
    stopping replica lets its requests run on (as uvicorn's grace does
    without replicas) before it is stopped."""
    from ray import serve

    logging = {"log_level": log_level.upper(), "enable_access_log": log_level in ("debug", "info")}

    engines = serve.deployment(EngineReplica, name=DEPLOYMENT, num_replicas=replicas,
                               ray_actor_options={"num_gpus": 1} if gpus else {"num_cpus": 1},
                               max_ongoing_requests=settings.max_live + HEADROOM,
                               health_check_period_s=health_check_period_s,
                               health_check_timeout_s=max(10.0, 5 * health_check_period_s),
                               graceful_shutdown_timeout_s=grace_s,
                               logging_config=logging)
    # The relay only moves bytes: no CPU reserved, so it never waits for one.
    # One relay process per engine replica: a single relay's Python loop,
    # handing every request and every streamed message on, capped two H200
    # replicas at ~1.1-1.6x one.
    relay = serve.deployment(Relay, name=RELAY, num_replicas=replicas, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=max(1000, 4 * settings.max_live),
                             logging_config=logging)
    return relay.bind(engines.bind(make_engine, settings), settings)


def stop(name: str = APP) -> None:
    """End the application ``name``, then Ray Serve. ``serve.shutdown`` alone
    kills Ray's HTTP proxy at once, cutting every open connection without
    an answer. Deleting the application first keeps the proxy while each
    replica finishes its requests, for up to its grace; a replica still busy
    then is stopped, and the relay answers its requests in the server's
    error shape (a 503 naming the replica, or a last error event)."""
    from ray import serve

    try:
        serve.delete(name)
    finally:
        serve.shutdown()


def deploy_failure() -> tuple[str, str] | None:
    """Why ``serve.run`` failed, when a replica could not start: the
    exception's class name and message, from the last line of the
    traceback Ray keeps (the engine's own error: a bad model path or
    option); None when no deployment failed."""
    from ray import serve

    for app in serve.status().applications.values():
        for deployment in app.deployments.values():
            lines = (deployment.message or "").strip().splitlines()
            if deployment.status == "DEPLOY_FAILED" and lines:
                kind, _, message = lines[-1].partition(": ")
                return kind.rsplit(".", 1)[-1], message
    return None
