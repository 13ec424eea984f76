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

At shutdown (``stop``) the relays answer until Ray's proxy closes the port:
each refuses every new request with a 503 naming the server's shutdown,
lets the requests it holds finish within the grace, and cuts what still
runs, answered as one server answers a request its shutdown cut. Only then
does Ray Serve stop, its proxy first.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from starlette.types import Message

from bubblefree.engine import Engine
from bubblefree.server.settings import ServerSettings
from bubblefree.server.relay import CUT_S, Relay

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
# How often a stopping replica looks for requests still running. Its first
# look waits one loop: at Ray's 2 s, after ``stop``'s drain had left none
# running, every replica idled 2 s before it stopped.
WAIT_LOOP_S = 0.2


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


def application(make_engine: Callable[[], Engine], settings: ServerSettings, replicas: int, *,
                gpus: bool, health_check_period_s: float = 2.0, log_level: str = "info",
                grace_s: float = 5.0) -> Any:
    """The Ray Serve application: the relay in front of ``replicas`` engine
    replicas, each around ``make_engine()``, one GPU each if ``gpus``.
    ``serve.run`` it; ``stop()`` ends it. ``log_level`` is the server's: Ray
    Serve's per-request access log (two lines a request, relay and replica)
    only at ``info`` or ``debug``, as uvicorn's. ``grace_s``: how long a
    replica that Ray stops (one replaced, say) lets its requests run on
    (as uvicorn's grace does without replicas) before it is stopped;
    ``stop`` gives the requests in flight its own grace first."""
    from ray import serve

    logging = {"log_level": log_level.upper(), "enable_access_log": log_level in ("debug", "info")}

    engines = serve.deployment(EngineReplica, name=DEPLOYMENT, num_replicas=replicas,
                               ray_actor_options={"num_gpus": 1} if gpus else {"num_cpus": 1},
                               max_ongoing_requests=settings.max_live + HEADROOM,
                               health_check_period_s=health_check_period_s,
                               health_check_timeout_s=max(10.0, 5 * health_check_period_s),
                               graceful_shutdown_timeout_s=grace_s, graceful_shutdown_wait_loop_s=WAIT_LOOP_S,
                               logging_config=logging)
    # The relay only moves bytes: no CPU reserved, so it never waits for one.
    # One relay process per engine replica: a single relay's Python loop,
    # handing every request and every streamed message on, capped two H200
    # replicas at ~1.1-1.6x one.
    relay = serve.deployment(Relay, name=RELAY, num_replicas=replicas, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=max(1000, 4 * settings.max_live),
                             graceful_shutdown_wait_loop_s=WAIT_LOOP_S, logging_config=logging)
    return relay.bind(engines.bind(make_engine, settings), settings)


def stop(name: str = APP, grace_s: float = 5.0) -> None:
    """End the application ``name``, then Ray Serve, answering every request
    in the server's shape until the port closes. Every relay drains first
    (``Relay.drain``): a new request gets a 503 naming the shutdown, with
    ``Retry-After``; one in flight has ``grace_s`` to end (uvicorn's grace
    without replicas), and what still runs then is cut and answered. Only
    then ``serve.shutdown``, which stops Ray's proxy before anything else:
    alone, it cut every open connection without an answer.

    Not ``serve.delete`` first: it takes the application's route off the
    proxy at once, and until ``serve.shutdown`` stopped the proxy (seconds,
    while the replicas stopped) every new request got Ray's plain-text
    ``404 Path not found``, which a client or a load balancer takes for a
    missing route, not a server going away."""
    from ray import serve

    try:
        _drain(name, grace_s)
    finally:
        serve.shutdown()


def _drain(name: str, grace_s: float) -> None:
    """``Relay.drain`` on every relay of the application ``name``; until
    all are drained, or past the longest a drain takes."""
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.exceptions import RayServeException

    try:
        relays = serve.get_deployment_handle(RELAY, name)
        drained = relays.broadcast("drain", grace_s)
        drained.results(timeout_s=grace_s + CUT_S + 5, return_exceptions=True)  # 5 s to find the relays
    except (KeyError, RayServeException, RayError, TimeoutError):
        pass  # no relay runs (the start failed, or was interrupted): none holds a request


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
