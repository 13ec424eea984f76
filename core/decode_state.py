"""The one thing the core knows about skills: a per-request decode state.

A skill (``skills/``) compiles, once per tokenizer, the allowed-token set of
each of its states and registers every set with the engine
(``Engine.register_mask``), which hands them to the backend (device-resident
tables on the GPU). Per step a sequence then contributes only a mask id: the
hot path never touches the vocabulary.

I9: the engine asks ``mask_id()`` in the finalize phase, after the commit of
the previous step has called ``advance`` — so the mask for step t+1 always
reflects the token committed at step t — and checks at commit that the
sampled token lies in the set it registered under that id.

Values: a state that also has ``value_kind()`` is asked it right after
``mask_id()``; a ``ValueKind`` makes the backend decode that value beside the
token (its region head) and hand it to ``advance``. The commit checks it has
its kind's shape and range (I13). A state without the method asks none.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from bubblefree.core.values import Request, ValueKind, message


@runtime_checkable
class DecodeState(Protocol):
    def mask_id(self) -> int | None:
        """Registered mask id for the next token; ``None`` allows any token."""
        ...

    def advance(self, token: int, value: float | tuple[float, float] | None) -> bool:
        """Consume one committed token and the value its step decoded: a float
        (COORD), a (width, height) pair (SIZE), or None when ``value_kind()``
        asked none. Return True when the output is complete. Called for
        every committed token, in order, once: the stop token and the token
        that reaches ``max_tokens`` included (docs/contracts.md)."""
        ...

    # Optional: ``value_kind(self) -> ValueKind | None``, the value to decode
    # beside the next token; absent means None (``ask_value``).
    # Optional: ``may_end(self) -> bool``, whether the next token can end the
    # output; absent means True. Timing only: ``pipelined="auto"`` weighs it
    # (``ahead.py``); a wrong answer costs speed, never a token.


# -- calls into a skill, guarded: a skill's bug fails its own request only ---

def who(request: Request) -> str:
    return f"skill {request.skill!r}" if request.skill else "decode state"


def guarded(request: Request, call: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, reason)`` when the skill raised; the
    reason names the skill and keeps its own exception's type and message.
    Any exception but the two that ask the process to stop: a skill's
    CancelledError or GeneratorExit is its bug too."""
    try:
        return fn(*args), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - the caller fails this request only
        return None, f"{who(request)} raised {type(err).__name__} in {call}: {message(err)}"


def held_elsewhere(request: Request, holder: int | None) -> str | None:
    """Why the state ``request``'s ``decode_state`` just returned cannot be
    its own, or None: ``holder``, the live request already holding that
    object. It would advance on both requests' tokens and merge their
    outputs; a state that has consumed tokens is caught by its skill set,
    but two requests admitted before either commits had consumed none."""
    if holder is None:
        return None
    return (f"{who(request)}: decode_state returned the state request {holder} holds: "
            f"each request needs a fresh state")


def stolen(request: Request, taker: int) -> str:
    """Why a live request fails when its decode state is handed to request
    ``taker`` too (``held_elsewhere``, the other side)."""
    return (f"{who(request)}: decode_state returned this request's state to request {taker} too: "
            f"each request needs a fresh state")


def _optional_call(state: Any, name: str) -> Any:
    """``state.name()``, or None where the state has no ``name`` (looked up
    here, under ``guarded``: a property that raises fails its request)."""
    method = getattr(state, name, None)
    return None if method is None else method()


def bad_mask(request: Request, mask: Any, masks: Mapping[int, frozenset[int]]) -> str | None:
    """Why ``mask`` (from ``mask_id()``) cannot go to sampling, or None. Checked
    before the backend sees it: an unknown id would fail every row sharing
    the step, a non-int would stop the engine."""
    if mask is None or (type(mask) is int and mask in masks):
        return None
    return f"{who(request)}: mask_id() returned {mask!r}, not a registered mask id"


def ask_value(request: Request, state: Any, values_ok: bool) -> tuple[ValueKind | None, str | None]:
    """``(kind, None)`` from the state's optional ``value_kind()``, or
    ``(None, reason)`` when it raised, returned something else than a
    ``ValueKind`` or None, or asked a value of a backend without a region
    head (``values_ok``): each fails this request only."""
    kind, error = guarded(request, "value_kind", _optional_call, state, "value_kind")
    if error is not None:
        return None, error
    if kind is None:
        return None, None
    if not isinstance(kind, ValueKind):
        return None, f"{who(request)}: value_kind() returned {kind!r}, not a ValueKind or None"
    if not values_ok:
        return None, f"{who(request)}: asked a {kind.value} value; this backend decodes no values"
    return kind, None
