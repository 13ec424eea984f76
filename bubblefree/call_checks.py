"""The checks ``Engine.submit`` and ``submit_many`` make of a call before
any skill sees it, and how a refused call of a batch is named
(``calls[2].question: ...``)."""

from __future__ import annotations

import inspect
import re
from typing import Any, Iterable

from bubblefree.core import InvalidRequest


def each_call(calls: Any) -> Iterable:
    # Not iterable (None, a lone call's skill name as an int...): named as
    # the other malformed calls are, an ``InvalidRequest``, not a bare TypeError.
    try:
        return iter(calls)
    except TypeError:
        raise InvalidRequest(f"calls: must be an iterable of (skill, arguments) pairs, got "
                             f"{type(calls).__name__}") from None


# A refusal's message opens with the field it names (``question: ...``,
# ``sampling.seed: ...``); one from a caller's odd argument name may not.
FIELD_FIRST = re.compile(r"[A-Za-z_][\w.]*: ")


def named(i: int, err: InvalidRequest) -> str:
    """``err``'s message naming ``submit_many``'s call ``i``: ``calls[2].question:
    ...``, or ``calls[2]: ...`` where the message opens with no field."""
    message = str(err)
    return f"calls[{i}].{message}" if FIELD_FIRST.match(message) else f"calls[{i}]: {message}"


def lone(err: InvalidRequest) -> InvalidRequest:
    """A lone call's refusal as its check raised it, ``question: ...``: the
    ``calls[0]`` that ``submit_many`` names it with means nothing to ``submit``."""
    return err.__cause__ if isinstance(err.__cause__, InvalidRequest) else err


def check_listener(listener: Any) -> None:
    if listener is not None and not callable(listener):
        raise InvalidRequest(f"listener: must be callable, got {type(listener).__name__}")
    # An object whose ``__call__`` is async is as async as an ``async def``;
    # the type's, as Python calls it. (What a lambda returns is seen only when
    # it runs: the core fails the request then.)
    call = getattr(type(listener), "__call__", None)
    if inspect.iscoroutinefunction(listener) or inspect.iscoroutinefunction(call):
        raise InvalidRequest("listener: must be a plain function; an async one would never run "
                             "(the decode thread calls it and awaits nothing)")
