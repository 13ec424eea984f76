"""A request's life inside the engine, and the table of its moves.

Phases::

    QUEUED ──admit──► ADMITTED ──prefill──► RUNNING
       │                 │                     │
       └─────────────────┴───── finish ────────┴──► FINALIZED ──teardown──► RELEASED

``finalized`` (the seed's field) is true from FINALIZED on: the result has
been emitted and nothing more is appended (I5). A FINALIZED sequence with
``inflight_refs > 0`` is a *zombie*: a launched step still includes it, so
its KV pages, row slot and adapter slot stay owned until the last such step
commits (I6). ``teardown`` is refused while any step still references it.

An illegal move raises ``IllegalTransition`` and leaves the sequence as it was.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from bubblefree.core.protocol import IllegalTransition, transition
from bubblefree.core.values import Request, Status


class Phase(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"  # owns pages and a row slot; prefill not launched yet
    RUNNING = "running"  # prefill launched; decodes until finalized
    FINALIZED = "finalized"  # result emitted; a zombie while inflight_refs > 0
    RELEASED = "released"  # resources returned (I6), gone from the engine


# The phases of a sequence whose request has ended (``Sequence.finalized``).
# Asked for each row at every tick: a tuple, compared by identity, costs a
# fifth of looking the members up on the enum each time, and half of a set
# (an enum member's hash is Python code).
ENDED = (Phase.FINALIZED, Phase.RELEASED)

# (phase, event) -> next phase. Anything absent is illegal.
TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.QUEUED, "admit"): Phase.ADMITTED,
    (Phase.ADMITTED, "prefill"): Phase.RUNNING,
    (Phase.QUEUED, "finish"): Phase.FINALIZED,
    (Phase.ADMITTED, "finish"): Phase.FINALIZED,
    (Phase.RUNNING, "finish"): Phase.FINALIZED,
    (Phase.FINALIZED, "teardown"): Phase.RELEASED,
}


@attrs.define(eq=False)
class Sequence:
    seq_id: int
    request: Request
    phase: Phase = Phase.QUEUED
    inflight_refs: int = 0  # I3: launched, uncommitted steps that include it
    tokens: list[int] = attrs.Factory(list)  # committed output tokens
    launched: int = 0  # tokens whose sampling has been launched (runs ahead of commits)
    state: Any = None  # the skill's DecodeState, built at admission
    state_held: bool = False  # its state was another live request's, or handed to another: no output
    pages: tuple[int, ...] = ()
    row_slot: int | None = None
    adapter_slot: int | None = None
    status: Status | None = None
    finish_reason: str = ""
    last_step: int = -1  # id of the newest step that included it (fair batching)

    @property
    def finalized(self) -> bool:
        return self.phase in ENDED

    @property
    def is_zombie(self) -> bool:
        return self.phase is Phase.FINALIZED and self.inflight_refs > 0

    @property
    def kv_len(self) -> int:
        """Positions written into the KV cache by launched steps: the image
        prefix and the prompt, then one per launched decode."""
        if self.launched == 0:
            return 0
        return self.request.prefix_len + self.launched - 1

    def move(self, event: str) -> None:
        nxt = transition(TRANSITIONS, self.phase, event, f"sequence {self.seq_id}")
        if event == "teardown" and self.inflight_refs != 0:
            # I6: a zombie's pages may still be written by a launched step.
            raise IllegalTransition(
                f"sequence {self.seq_id}: teardown with inflight_refs={self.inflight_refs}")
        self.phase = nxt

    def finish(self, status: Status, reason: str) -> None:
        self.move("finish")
        self.status = status
        self.finish_reason = reason
