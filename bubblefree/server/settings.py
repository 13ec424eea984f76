"""What a server is allowed to do, fixed when the app is built."""

from __future__ import annotations

import numbers

import attrs

from bubblefree.images import pillow_max_pixels


@attrs.frozen
class ServerSettings:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 2020  # where Moondream's client looks for a local server
    api_key: str | None = None  # None: no key asked for
    max_body_bytes: int = 20 * 1024 * 1024  # room for one large base64 image
    max_json_values: int = 200_000  # a body's values (parsed on the event loop; else 413)
    max_image_pixels: int = 50_000_000  # checked from the header, before decoding (bombs)
    max_live: int = 64  # requests decoding or waiting at once; more get 429
    request_timeout_s: float = 300.0  # a request still running then is cancelled (504)
    body_timeout_s: float = 30.0  # a request's whole body must arrive within this (else 408)
    max_header_bytes: int = 64 * 1024  # a request's line and headers together (else 431)
    header_timeout_s: float = 10.0  # they must arrive within this of the connection or last answer (else 408)
    retry_after_s: int = 1  # the Retry-After a 429 suggests
    # /health answers 503 once the decode thread has held requests this long
    # without finishing a step: a hung kernel or listener, its thread alive.
    stall_s: float = 60.0
    model_name: str = "bubblefree"  # what /v1/models lists and responses name

    def __attrs_post_init__(self) -> None:
        # Counts are integers: a NaN passed ``< 1`` (it fails every
        # comparison) and bounded nothing (``live >= nan`` never holds).
        for name in ("max_body_bytes", "max_json_values", "max_image_pixels", "max_live", "retry_after_s", "max_header_bytes"):
            value = getattr(self, name)
            if not (_is_a(value, numbers.Integral) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        most = pillow_max_pixels()
        if most is not None and self.max_image_pixels > most:
            raise ValueError(f"max_image_pixels must be at most {most}, the most pixels Pillow "
                             f"decodes, got {self.max_image_pixels}")
        for name in ("request_timeout_s", "body_timeout_s", "header_timeout_s", "stall_s"):
            value = getattr(self, name)
            if not (_is_a(value, numbers.Real) and value > 0):  # NaN fails ``> 0``
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.api_key is not None:  # the CLI's check, for an app built from Python too
            from bubblefree.server.guard import api_key_refusal
            refused = api_key_refusal(self.api_key) if isinstance(self.api_key, str) else "must be a string"
            if refused is not None:
                raise ValueError(f"api_key: {refused}")


def _is_a(value: object, kind: type) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)  # True is an int, but no setting's value
