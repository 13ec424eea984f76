"""The scheduler's integrity check: what must hold between any two calls.

Kept apart from ``scheduler.py`` so the keeper of the invariants and their
checker are read separately; the proof suite calls this after every phase.
"""

from __future__ import annotations

from bubblefree.core.slots import SlotState


class InvariantViolation(AssertionError):
    """A DESIGN.md invariant (named by its id in the message) does not hold."""


def check_integrity(sched) -> None:
    """I2-I6 as bookkeeping: pools balance (I6), every ``inflight_refs`` equals
    the in-flight steps that include the sequence and is at most 2 (I3), no
    sequence holds more than ``max_tokens`` (I5), in-flight steps are in id
    order and hold exactly the busy slots (I2, I4)."""
    sched.pages.check_integrity()
    sched.rows.check_integrity()
    sched.adapters.check_integrity()
    owned = sum(len(s.pages) for s in sched.seqs.values())
    if owned != sched.pages.num_owned:
        raise InvariantViolation(f"I6: sequences own {owned} pages, allocator says {sched.pages.num_owned}")
    for s in sched.seqs.values():
        refs = sum(s.seq_id in st.seq_ids for st in sched.inflight)
        if s.inflight_refs != refs or not 0 <= refs <= 2:
            raise InvariantViolation(
                f"I3: sequence {s.seq_id} inflight_refs={s.inflight_refs}, in {refs} steps")
        if len(s.tokens) > s.request.max_tokens:
            raise InvariantViolation(f"I5: sequence {s.seq_id} has {len(s.tokens)} tokens")
    ids = [st.step_id for st in sched.inflight]
    if ids != sorted(ids) or len(ids) > len(sched.pool.slots):
        raise InvariantViolation(f"I2/I4: in-flight steps {ids}")
    held = sorted(st.slot for st in sched.inflight)
    busy = sorted(s.index for s in sched.pool.slots if s.state is not SlotState.FREE)
    if held != busy:
        raise InvariantViolation(f"I4: steps hold slots {held}, busy slots {busy}")
