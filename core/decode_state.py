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
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from bubblefree.core.values import Request


@runtime_checkable
class DecodeState(Protocol):
    def mask_id(self) -> int | None:
        """Registered mask id for the next token; ``None`` allows any token."""
        ...

    def advance(self, token: int, value: float | None) -> bool:
        """Consume one committed token (and its spatial value, if the model
        decoded one). Return True when the output is complete. Called for
        every committed token, in order, once: the stop token and the token
        that reaches ``max_tokens`` included (docs/contracts.md)."""
        ...


# -- calls into a skill, guarded: a skill's bug fails its own request only ---

def who(request: Request) -> str:
    return f"skill {request.skill!r}" if request.skill else "decode state"


def guarded(request: Request, call: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, reason)`` when the skill raised; the
    reason names the skill and keeps its own exception's type and message."""
    try:
        return fn(*args), None
    except Exception as err:  # noqa: BLE001 - the caller fails this request only
        return None, f"{who(request)} raised {type(err).__name__} in {call}: {err}"


def bad_mask(request: Request, mask: Any, masks: Mapping[int, frozenset[int]]) -> str | None:
    """Why ``mask`` (from ``mask_id()``) cannot go to sampling, or None. Checked
    before the backend sees it: an unknown id would fail every row sharing
    the step, a non-int would stop the engine."""
    if mask is None or (type(mask) is int and mask in masks):
        return None
    return f"{who(request)}: mask_id() returned {mask!r}, not a registered mask id"
