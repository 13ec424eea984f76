"""``bubblefree serve --replicas N``: N engines on Ray Serve, each serving
the same app (``create_app``) as its ingress; Ray's proxy spreads requests
over them and its health checks replace one that dies.

Each replica builds its own engine when it starts (on its GPU, where the
cluster has GPUs), so nothing but the factory and the settings travels to
it. Every answer carries ``X-Bubblefree-Replica``, the replica's id, so a
client or a test can see how the load was spread and which replica failed.
"""

from __future__ import annotations

from typing import Any, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bubblefree.engine import Engine
from bubblefree.server.settings import ServerSettings

REPLICA_HEADER = "x-bubblefree-replica"
DEPLOYMENT = "bubblefree"


class ReplicaApp:
    """The app of one replica: adds its id to every answer and closes its
    engine when Ray shuts the replica down (the app does not own it)."""

    def __init__(self, app: ASGIApp, engine: Engine, replica_id: str):
        self.app, self.engine, self.replica_id = app, engine, replica_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        tag = (REPLICA_HEADER.encode(), self.replica_id.encode())

        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), tag]}
            await send(message)
        await self.app(scope, receive, tagged)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.engine.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def replica_id() -> str:
    from ray import serve
    context = serve.get_replica_context()
    return str(getattr(getattr(context, "replica_id", None), "unique_id", None) or context.replica_tag)


def application(make_engine: Callable[[], Engine], settings: ServerSettings, replicas: int, *,
                gpus: bool, health_check_period_s: float = 2.0) -> Any:
    """The Ray Serve application: ``replicas`` copies of the app, each around
    ``make_engine()``, one GPU each if ``gpus``. ``serve.run`` it."""
    from ray import serve

    from bubblefree.server.app import create_app

    def build() -> ReplicaApp:
        engine = make_engine()
        return ReplicaApp(create_app(engine, settings), engine, replica_id())

    options = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    deployment = serve.deployment(serve.ingress(build)(), name=DEPLOYMENT, num_replicas=replicas,
                                  ray_actor_options=options, max_ongoing_requests=settings.max_live,
                                  health_check_period_s=health_check_period_s,
                                  health_check_timeout_s=max(10.0, 5 * health_check_period_s))
    return deployment.bind()

