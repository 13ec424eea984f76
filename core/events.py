"""What happened in the scheduler, as values: it reports, it never calls out.

h11's rule, kept in calls and not only in imports: the state machine runs
no caller code. Each transition that a caller must hear of appends an event
to the scheduler's outbox; the Engine takes them once the scheduler is
consistent, turns them into handle updates and results, and only then runs
listeners. A listener can therefore neither see a half-applied commit nor
break one, whatever it does (cancel, raise, submit).
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class TokenCommitted:
    """A token was appended to a sequence (I5: never after its end)."""

    seq_id: int
    token: int


@attrs.frozen
class SequenceEnded:
    """A sequence ended (I7: once). ``seq`` is the Sequence itself: its status,
    reason, tokens and skill state are final from here on, even after it is
    torn down and gone from the scheduler."""

    seq: Any

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


Event = TokenCommitted | SequenceEnded
