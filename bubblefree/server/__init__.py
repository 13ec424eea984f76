"""An HTTP server for an ``Engine``: Moondream's and OpenAI's APIs.

    from bubblefree.server import create_app, http_protocol, ServerSettings
    settings = ServerSettings(api_key="...")
    uvicorn.run(create_app(engine, settings), http=http_protocol(settings))

(``http_protocol`` bounds each request's headers: their size, and the time
they take to arrive), or from a shell: ``bubblefree serve [MODEL] --port 2020``.
"""

from bubblefree.server.app import create_app
from bubblefree.server.protocol import http_protocol
from bubblefree.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "http_protocol"]
