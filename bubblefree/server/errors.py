"""Every refusal as one JSON shape, OpenAI's: ``{"error": {"message", "type",
"param", "code"}}``. Both clients read it: OpenAI's parses it into its
exception, Moondream's raises ``HTTPError`` carrying it.

``param`` names the field at fault, so a caller can fix the request without
reading the server's logs.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
          422: "invalid_request_error", 429: "rate_limit_error", 431: "request_too_large", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


# A refusal quotes what the client sent; these bound how much of it. A
# 4,000-digit seed, a megabyte role or an unknown field named by a 1 MB key
# came back whole, an answer as large as the request it refused.
MAX_MESSAGE, MAX_PARAM = 500, 100


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _clipped(message, MAX_MESSAGE), "type": _TYPES.get(status, "server_error"),
                      "param": None if param is None else _clipped(param, MAX_PARAM), "code": status}}


def _clipped(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most - 1] + "\u2026"


class ErrorJSON(JSONResponse):
    """A refusal's body, escaped to ASCII: its message quotes what the
    client sent, and a field name holding a lone surrogate (valid JSON,
    ``"\\ud800"``) has no UTF-8 form; rendered raw it failed inside the
    error handler and the client got a plain-text 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_json(status: int, message: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> ErrorJSON:
    return ErrorJSON(error_body(status, message, param), status, headers)


def error_response(err: ApiError) -> ErrorJSON:
    return error_json(err.status, err.message, err.param, err.headers)


def field_of(message: str) -> str | None:
    """The field an ``InvalidRequest`` names: its messages start ``field: ...``."""
    head, sep, _ = message.partition(":")
    return head if sep and head and " " not in head else None


async def on_api_error(request: Request, err: ApiError) -> ErrorJSON:
    return error_response(err)


async def on_http_error(request: Request, err: Any) -> ErrorJSON:
    """Starlette's own refusals (no such route, wrong method) in the same shape."""
    status = getattr(err, "status_code", 500)
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(status, str(err.detail))
    return error_json(status, message, None, getattr(err, "headers", None))
