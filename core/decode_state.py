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

from typing import Protocol, runtime_checkable


@runtime_checkable
class DecodeState(Protocol):
    def mask_id(self) -> int | None:
        """Registered mask id for the next token; ``None`` allows any token."""
        ...

    def advance(self, token: int, value: float | None) -> bool:
        """Consume one committed token (and its spatial value, if the model
        decoded one). Return True when the output is complete."""
        ...
