"""The fake's own check on a plan, beyond the contract's ``check_plan``.

Step ids must rise from launch to launch: the simulated memory replays work
in enqueue order and names each piece by its step, so a reused id would let
one step's copy pass for another's. A real GPU has no such need, so this is
not part of the contract.
"""

from __future__ import annotations

from bubblefree.core.values import StepPlan
from bubblefree.fake_backend.errors import HardwareMisuse


def check_step_order(plan: StepPlan, last_step_id: int | None) -> None:
    # I2 rests on launch order being step order; a step id is never reused
    # once its forward was enqueued.
    if last_step_id is not None and plan.step_id <= last_step_id:
        raise HardwareMisuse(f"step {plan.step_id}: step ids must increase; the last launched was "
                             f"{last_step_id}")
