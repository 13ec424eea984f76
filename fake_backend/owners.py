"""Who owns each KV page, row slot and adapter slot, on the device's timeline.

The host hands a page to a sequence when a plan names it; the device touches
the page when that plan's forward runs, which on a pipelined engine is later,
in virtual time, than the host's next decisions. So ownership is checked at
device time: when a plan names a page (row slot, adapter slot) for one
sequence while a forward of another sequence is still to run over it, or is
running, the page was handed on while still owned (I6). Real hardware would
let both forwards write and read it, and answer with silently wrong tokens;
here it raises ``KVCorruption`` naming both sequences and both steps.

The fake learns ownership from what it is told, never from the core's
bookkeeping: each plan's pages, row slot and adapter slot per row claim them
for that row's sequence at the host time of the launch call; each use lasts
until the device work that touches it ends (the forward for KV pages and
adapter weights, the sampling for the row slot's token).

A step whose finalize fails is abandoned on the device: nothing reads what
its forward wrote, so its uses are dropped (``forget``) and the engine may
hand its pages on as soon as it has seen the failure.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from bubblefree.core.values import StepPlan, StepRow
from bubblefree.fake_backend.errors import KVCorruption


@attrs.frozen
class Use:
    id: int
    seq_id: int
    step_id: int
    until: float  # virtual time at which the device work touching the id ends


@attrs.define
class Owners:
    what: str  # "KV page", "row slot", "adapter slot"
    # A few uses at a time (the steps in flight), kept as one immutable
    # tuple: a search snapshots it by sharing it.
    uses: tuple[Use, ...] = ()

    def check(self, ids: Iterable[int], seq_id: int, step_id: int, at: float) -> None:
        """Raise if another sequence's device work on any of ``ids`` ends
        after ``at``, the host time at which ``seq_id``'s plan names them."""
        ids = set(ids)
        for use in self.uses:
            if use.id in ids and use.seq_id != seq_id and use.until > at:
                raise KVCorruption(
                    f"step {step_id}: {self.what} {use.id} named for seq {seq_id} at t={at:g}, while seq "
                    f"{use.seq_id}'s step {use.step_id} touches it on the device until t={use.until:g}: "
                    f"handed on while still owned (I6)")

    def touch(self, ids: Iterable[int], seq_id: int, step_id: int, until: float, now: float) -> None:
        """``step_id``'s device work for ``seq_id`` uses ``ids`` until ``until``;
        uses already over at host time ``now`` are forgotten."""
        ids = tuple(ids)
        kept = tuple(u for u in self.uses if u.until > now and not (u.step_id == step_id and u.id in ids))
        self.uses = kept + tuple(Use(i, seq_id, step_id, until) for i in ids)

    def forget(self, step_id: int) -> None:
        """The step's device work was abandoned: it claims nothing any more."""
        self.uses = tuple(u for u in self.uses if u.step_id != step_id)


@attrs.define
class Ownership:
    """The three pools a row names, checked and touched together."""

    pages: Owners = attrs.Factory(lambda: Owners("KV page"))
    rows: Owners = attrs.Factory(lambda: Owners("row slot"))
    adapters: Owners = attrs.Factory(lambda: Owners("adapter slot"))

    def claim(self, plan: StepPlan, at: float) -> None:
        """The plan names its rows' ids at host time ``at``: raises, changing
        nothing, if another sequence's device work still uses one."""
        for row in plan.rows:
            for owners, ids in self._ids(row):
                owners.check(ids, row.seq_id, plan.step_id, at)

    def forward(self, plan: StepPlan, until: float, now: float) -> None:
        """The forward reads and writes its rows' pages and adapter weights,
        and reads their row slots, until ``until``."""
        for row in plan.rows:
            for owners, ids in self._ids(row):
                owners.touch(ids, row.seq_id, plan.step_id, until, now)

    def sampled(self, plan: StepPlan, until: float, now: float) -> None:
        """Sampling writes each row's token into its row slot until ``until``."""
        for row in plan.rows:
            self.rows.touch((row.row_slot,), row.seq_id, plan.step_id, until, now)

    def forget(self, step_id: int) -> None:
        for owners in (self.pages, self.rows, self.adapters):
            owners.forget(step_id)

    def key(self, now: float, rel) -> tuple:
        """The uses still to end after ``now``, times relative to it (for a
        search's canonical state)."""
        return tuple(tuple(sorted((u.id, u.seq_id, rel(u.step_id), u.until - now) for u in o.uses if u.until > now))
                     for o in (self.pages, self.rows, self.adapters))

    def _ids(self, row: StepRow) -> tuple[tuple[Owners, tuple[int, ...]], ...]:
        adapter = () if row.adapter_slot is None else (row.adapter_slot,)
        return (self.pages, row.pages), (self.rows, (row.row_slot,)), (self.adapters, adapter)
