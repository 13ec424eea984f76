"""The scheduler's integrity check: what must hold between any two calls,
and the check of a step's values at its commit (I13).

Kept apart from ``scheduler.py`` so the keeper of the invariants and their
checker are read separately; the proof suite calls this after every phase.
"""

from __future__ import annotations

from bubblefree.core.sequence import Phase
from bubblefree.core.slots import SlotState, Step
from bubblefree.core.values import bad_value


class InvariantViolation(AssertionError):
    """A DESIGN.md invariant (named by its id in the message) does not hold."""


def check_integrity(sched) -> None:
    """I2-I6 as bookkeeping: pools balance (I6), every ``inflight_refs`` equals
    the in-flight steps that include the sequence and is at most 2 (I3), no
    sequence holds more than ``max_tokens`` (I5), in-flight steps are in id
    order, hold exactly the busy slots and name only sequences not yet
    released (I2, I4, I6)."""
    sched.pages.check_integrity()
    sched.rows.check_integrity()
    sched.adapters.check_integrity()
    owned = sum(len(s.pages) for s in sched.seqs.values())
    if owned != sched.pages.num_owned:
        raise InvariantViolation(f"I6: sequences own {owned} pages, allocator says {sched.pages.num_owned}")
    check_owners(sched)
    for s in sched.seqs.values():
        refs = sum(s.seq_id in st.seq_ids for st in sched.inflight)
        if s.inflight_refs != refs or not 0 <= refs <= 2:
            raise InvariantViolation(
                f"I3: sequence {s.seq_id} inflight_refs={s.inflight_refs}, in {refs} steps")
        if len(s.tokens) > s.request.max_tokens:
            raise InvariantViolation(f"I5: sequence {s.seq_id} has {len(s.tokens)} tokens")
    held = {id(s.state): s.seq_id for s in sched.seqs.values() if s.state is not None and not s.finalized}
    if held != sched.held:
        raise InvariantViolation(f"I14: live requests hold the states {sorted(held.values())}, "
                                 f"the register says {sorted(sched.held.values())}")
    gone = [sid for st in sched.inflight for sid in st.seq_ids if sid not in sched.seqs]
    if gone:
        raise InvariantViolation(f"I6: in-flight steps include sequences {gone}, already released")
    ids = [st.step_id for st in sched.inflight]
    if ids != sorted(ids) or len(ids) > len(sched.pool.slots):
        raise InvariantViolation(f"I2/I4: in-flight steps {ids}")
    held = sorted(st.slot for st in sched.inflight)
    busy = sorted(s.index for s in sched.pool.slots if s.state is not SlotState.FREE)
    if held != busy:
        raise InvariantViolation(f"I4: steps hold slots {held}, busy slots {busy}")


def check_owners(sched) -> None:
    """I6, ownership: from admission to teardown a sequence holds what it was
    admitted with (its KV pages, a row slot, and an adapter slot if its
    request names an adapter). A zombie is no exception: it owns them until
    its last in-flight step commits, since that step's forward may still
    write its pages and read its adapter on the device. Each pool owns
    exactly its sequences' ids, none of them twice."""
    pages: list[int] = []
    rows: list[int] = []
    adapters: list[int] = []
    for s in sched.seqs.values():
        admitted = s.phase is not Phase.QUEUED
        adapter = admitted and s.request.adapter is not None
        if (bool(s.pages), s.row_slot is not None, s.adapter_slot is not None) != (admitted, admitted, adapter):
            raise InvariantViolation(
                f"I6: sequence {s.seq_id} ({s.phase.value}, inflight_refs={s.inflight_refs}) holds pages "
                f"{s.pages}, row slot {s.row_slot}, adapter slot {s.adapter_slot}")
        pages += s.pages
        if admitted:
            rows.append(s.row_slot)
        if adapter:
            adapters.append(s.adapter_slot)
    for pool, ids in ((sched.pages, pages), (sched.rows, rows), (sched.adapters, adapters)):
        if sorted(ids) != sorted(pool.owned):
            raise InvariantViolation(
                f"I6: sequences hold {pool.name} {sorted(ids)}, the pool owns {sorted(pool.owned)}")


def check_values(step: Step, values: tuple | None) -> None:
    """I13: a row that asked a value got one of its kind's shape and range; a
    row that asked none got None. Like I9 for tokens, a backend that breaks
    this is a bug, not a device fault: raised, never handed to a skill."""
    if not step.value_kinds and (values is None or values.count(None) == len(step.seq_ids)):
        return  # the common case: no row asked, none answered
    kinds = step.value_kinds or (None,) * len(step.seq_ids)
    if values is None:
        values = (None,) * len(kinds)
    elif len(values) != len(kinds):
        raise InvariantViolation(f"I13: step {step.step_id} returned {len(values)} values "
                                 f"for {len(kinds)} rows")
    for sid, kind, value in zip(step.seq_ids, kinds, values):
        why = bad_value(kind, value)
        if why is not None:
            raise InvariantViolation(f"I13: sequence {sid} in step {step.step_id}: {why}")
