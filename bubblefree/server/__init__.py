"""An HTTP server for an ``Engine``: Moondream's and OpenAI's APIs.

    from bubblefree.server import create_app, ServerSettings
    app = create_app(engine, ServerSettings(api_key="..."))

or from a shell: ``bubblefree serve [MODEL] --port 2020``.
"""

from bubblefree.server.app import create_app
from bubblefree.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
