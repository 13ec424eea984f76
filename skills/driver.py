"""Run a skill request without an engine: the smallest loop that honours the
decode-state contract. Tests use it to drive states with adversarial token
choices; the engine's tests then check the engine gives the same results.

    recorder = MaskRecorder()
    skills = SkillSet(tokenizer, recorder.register)
    tokens, output = drive(skills.request("point", object="cat"), recorder, pick)

``pick(allowed, step)`` returns ``(token, value)`` for one step; ``allowed``
is the registered set, or ``None`` when the state allows anything. A state
that asks a value (``value_kind()``, a region head) gets it from
``values(kind, step)`` instead, as a backend decodes it beside the token.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from bubblefree.core.values import Request, ValueKind

Pick = Callable[[frozenset[int] | None, int], tuple[int, float | None]]


@attrs.define
class MaskRecorder:
    """A ``register_mask`` that keeps every set, as an engine would; counts
    registrations so tests can check each set is registered once."""

    masks: list[frozenset[int]] = attrs.Factory(list)

    def register(self, allowed: frozenset[int]) -> int:
        self.masks.append(frozenset(allowed))
        return len(self.masks) - 1

    def allowed(self, mask_id: int | None) -> frozenset[int] | None:
        return None if mask_id is None else self.masks[mask_id]


class NotAllowed(AssertionError):
    """The pick broke I9: it chose a token its state's mask excludes."""


def drive(request: Request, masks: MaskRecorder, pick: Pick,
          stop_after: int | None = None,
          values: Callable[[ValueKind, int], Any] | None = None) -> tuple[tuple[int, ...], Any]:
    """Run ``request`` to its end (EOS, done, or ``max_tokens``), or stop early
    after ``stop_after`` tokens as a cancel would; return tokens and output."""
    state = request.decode_state()
    tokens: list[int] = []
    limit = request.max_tokens if stop_after is None else min(stop_after, request.max_tokens)
    while len(tokens) < limit:
        allowed = masks.allowed(state.mask_id())  # I9: after the last advance
        kind = state.value_kind() if hasattr(state, "value_kind") else None
        token, value = pick(allowed, len(tokens))
        if kind is not None:
            if values is None:
                raise AssertionError(f"step {len(tokens)} asks a {kind.value} value; pass values=")
            value = values(kind, len(tokens))
        if allowed is not None and token not in allowed:
            raise NotAllowed(f"I9: step {len(tokens)} picked {token}, not in its mask")
        tokens.append(token)
        done = state.advance(token, value)
        if done or token in request.stop_ids:
            break
    return tuple(tokens), request.finisher(tuple(tokens), state)
