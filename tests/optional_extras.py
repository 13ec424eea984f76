"""Which optional extra a test file's import error asks for (``conftest``'s
collection hook): a GPU machine runs ``pytest -m gpu`` without the serving
stack, and the files that need it are then skipped by name, not errors."""

from __future__ import annotations

import re

# The optional packages the tests import, by the extra that installs them
# (pyproject.toml); moondream's client comes from the Makefile, without its
# dependencies (they are for its own inference, which the tests do not use).
EXTRAS = {"fastapi": "server", "starlette": "server", "uvicorn": "server", "httptools": "server",
          "prometheus_client": "server",
          "PIL": "images", "httpx": "test", "openai": "test", "ray": "ray"}
NO_DEPS = {"moondream"}
MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def skip_reason(error: str, ci: bool) -> str | None:
    """The skip's reason for a file whose collection failed with ``error``
    where that error is an optional package missing, else None. None under
    CI too: ``make test`` installs every one, so one missing there is a
    broken install, which must fail."""
    found = MISSING.search(error)
    if found is None or ci:
        return None
    module = found.group(1)
    top = module.split(".")[0]
    if top in NO_DEPS:
        return f"needs {top}'s package ({module}): pip install --no-deps {top}"
    if top in EXTRAS:
        return f"needs the {EXTRAS[top]} extra ({module}): pip install 'bubblefree[{EXTRAS[top]}]'"
    return None
