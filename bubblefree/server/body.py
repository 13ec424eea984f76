"""A request's JSON body read and checked field by field.

The body is read by hand rather than through pydantic models: every
refusal must name the field and say what was wrong in the words the error
table in docs/server.md uses, and a body over the size limit must stop
being read at the limit.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterator

from starlette.requests import ClientDisconnect, Request

from bubblefree.core import InvalidRequest, SamplingParams
from bubblefree.core.values import too_big
from bubblefree.server.errors import ApiError

MISSING = object()  # a field the body does not have (null is a value)


async def read_json(request: Request, max_values: int) -> "Fields":
    """The body as ``Fields``; refused (naming ``body``) if it is not UTF-8
    JSON holding an object, or holds more than ``max_values`` values."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ApiError(400, "body: the client left before sending the whole body", "body") from None
    _check_values(raw, max_values)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ApiError(400, f"body: not UTF-8 ({err.reason} at byte {err.start})", "body") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"body: not valid JSON ({err})", "body") from None
    if not isinstance(value, dict):
        raise ApiError(422, f"body: must be a JSON object, got {type(value).__name__}", "body")
    return Fields(value)


def _check_values(raw: bytes, most: int) -> None:
    """Refuse a body of more than ``most`` JSON values before parsing it.

    The parser runs on the event loop and holds the GIL (a thread would not
    free the loop): a 20 MB body of small numbers took seconds, every other
    client waiting. Commas bound the values (each value after the first in
    an array or object follows one; nesting without them ends at the
    parser's depth limit); counting them costs a fraction of a parse. A
    comma inside a string counts too, so the bound over-counts text: at the
    default a prompt would need more commas than any context has tokens."""
    commas = raw.count(b",")
    if commas >= most:
        raise ApiError(413, f"body: more than this server's limit of {most} JSON values "
                            f"({commas} commas)", "body")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class Fields:
    """The body's fields, taken one by one; ``done()`` refuses the rest."""

    MISSING = MISSING

    def __init__(self, values: dict[str, Any], prefix: str = ""):
        self._values = dict(values)
        self._prefix = prefix

    def name(self, field: str) -> str:
        return f"{self._prefix}{field}"

    def refuse(self, field: str, problem: str, status: int = 422) -> ApiError:
        return ApiError(status, f"{self.name(field)}: {problem}", self.name(field))

    def raw(self, field: str) -> Any:
        return self._values.pop(field, MISSING)

    def text(self, field: str, default: Any = MISSING) -> Any:
        value = self.raw(field)
        if value is MISSING or (value is None and default is not MISSING):
            if default is MISSING:
                raise self.refuse(field, "is required")
            return default
        if not isinstance(value, str):
            raise self.refuse(field, f"must be a string, got {kind_of(value)}")
        return value

    def flag(self, field: str, default: bool = False) -> bool:
        value = self.raw(field)
        if value is MISSING or value is None:
            return default
        if not isinstance(value, bool):
            raise self.refuse(field, f"must be true or false, got {kind_of(value)}")
        return value

    def integer(self, field: str, low: int, default: Any = None) -> Any:
        value = self.raw(field)
        if value is MISSING or value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.refuse(field, f"must be an integer, got {kind_of(value)}")
        if value < low:
            raise self.refuse(field, f"must be >= {low}, got {value}")
        return value

    def number(self, field: str, default: Any = None) -> Any:
        """A finite number; its range is the engine's to check (it names it)."""
        value = self.raw(field)
        if value is MISSING or value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.refuse(field, f"must be a number, got {kind_of(value)}")
        try:
            as_float = float(value)
        except OverflowError:  # JSON integers have no bound; a float's range ends near 1.8e308
            raise self.refuse(field, f"must be finite, got {too_big(value)}, past a float's range") from None
        if not math.isfinite(as_float):
            raise self.refuse(field, f"must be finite, got {value!r}")
        return value

    def nested(self, field: str) -> "Fields | None":
        value = self.raw(field)
        if value is MISSING or value is None:
            return None
        if not isinstance(value, dict):
            raise self.refuse(field, f"must be an object, got {kind_of(value)}")
        return Fields(value, prefix=f"{self.name(field)}.")

    def items(self, field: str) -> list[Any]:
        value = self.raw(field)
        if value is MISSING:
            raise self.refuse(field, "is required")
        if not isinstance(value, list):
            raise self.refuse(field, f"must be an array, got {kind_of(value)}")
        return value

    def done(self) -> None:
        if self._values:
            names = ", ".join(sorted(self.name(k) for k in self._values))
            raise ApiError(422, f"{names}: unknown field(s)", self.name(sorted(self._values)[0]))


def valid_text(text: str, name: str) -> str:
    """``text``, refused naming ``name`` if it holds a lone surrogate: valid
    JSON (``"\\ud800"``) that has no UTF-8 form, so no tokenizer can encode
    it. The skills' own check (``skills.base.text_arg``) words it the same."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(422, f"{name}: is not valid text ({err.reason} at position {err.start})", name) from None
    return text


def each_object(items: list[Any], where: str) -> Iterator[tuple[str, Fields]]:
    """Each element of an array of objects as ``(its name, its Fields)``;
    an element that is not an object is refused by its name."""
    for i, item in enumerate(items):
        name = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ApiError(422, f"{name}: must be an object, got {kind_of(item)}", name)
        yield name, Fields(item, prefix=f"{name}.")


def kind_of(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def sampling_values(fields: Fields) -> dict[str, Any]:
    """The sampling fields ``fields`` has, as ``SamplingParams.of`` takes
    them (its range checks are the engine's): ``temperature``, ``top_p``,
    ``min_p`` (numbers), ``top_k`` and ``seed`` (integers). A ``top_k`` of
    -1 is no limit, as vLLM spells it, so its clients' requests are taken
    unchanged."""
    values = {k: v for k in ("temperature", "top_p", "min_p") if (v := fields.number(k)) is not None}
    if (top_k := fields.integer("top_k", -1)) is not None:
        values["top_k"] = max(top_k, 0)  # -1: vLLM's no limit, our 0
    if (seed := fields.integer("seed", 0)) is not None:
        values["seed"] = seed
    return values


def sampling_params(values: dict[str, Any], prefix: str) -> SamplingParams:
    """``SamplingParams`` with the engine's range checks, the field named as
    the client spelled it (``settings.temperature``, ``temperature``)."""
    try:
        return SamplingParams.of(values)
    except InvalidRequest as err:
        message = str(err).replace("sampling.", prefix, 1)
        param = message.partition(":")[0]
        raise ApiError(422, message, param) from None
