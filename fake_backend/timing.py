"""The caller's choices: how long each piece of work takes, and where faults hit.

The fake owns no randomness. A test draws durations and faults from its own
data (Hypothesis ``st.data()``) and hands them in here, so a failure shrinks
to a minimal schedule and replays exactly. Slow forwards, delayed copies and
expensive commits are nothing more than numbers in a ``Timing``.

A duration is a number, or a callable taking the ``Work`` it times; use
``by_step`` for a table keyed by step id. Device durations (``forward``,
``sampling``, ``copy``) run on the simulated queues; host costs advance the
host clock inside the call that pays them.
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

import attrs

from bubblefree.core.values import StepKind


@attrs.frozen
class Work:
    """What a duration is chosen for."""

    step_id: int
    index: int  # the n-th launch call on this backend, from 0, failed ones included
    kind: StepKind
    rows: int
    tokens: int  # input tokens: the prompts for a prefill, one per row for a decode


Duration = Union[float, Callable[[Work], float]]


def by_step(table: Mapping[int, float], default: Duration) -> Callable[[Work], float]:
    """A duration looked up by step id, ``default`` for steps not in ``table``."""

    def pick(work: Work) -> float:
        if work.step_id in table:
            return table[work.step_id]
        return default(work) if callable(default) else default

    return pick


def _default_forward(work: Work) -> float:
    # Weight streaming is a fixed floor; each input token adds a little.
    return 1.0 + 0.01 * work.tokens


@attrs.frozen
class Timing:
    forward: Duration = _default_forward
    sampling: Duration = 0.05
    copy: Duration = 0.02
    launch_cost: Duration = 0.1  # host: plan the step, launch the forward
    finalize_cost: Duration = 0.05  # host: build masks, enqueue sampling and copy
    commit_cost: Duration = 0.0  # host: fixed part of a commit, paid when wait returns
    commit_cost_per_row: Duration = 0.02  # host: per committed row, paid when wait returns
    release_cost: Duration = 0.0

    @classmethod
    def zero(cls) -> "Timing":
        """Everything free: what remains is the engine's own CPU bookkeeping."""
        return cls(forward=0.0, sampling=0.0, copy=0.0, launch_cost=0.0, finalize_cost=0.0,
                   commit_cost=0.0, commit_cost_per_row=0.0, release_cost=0.0)

    def of(self, name: str, work: Work) -> float:
        spec = getattr(self, name)
        value = float(spec(work) if callable(spec) else spec)
        if not value >= 0.0:
            raise ValueError(f"Timing.{name} for step {work.step_id} must be >= 0, got {value!r}")
        return value


FAULT_KINDS = ("launch", "finalize", "sampling", "copy")


@attrs.frozen
class Fault:
    """A device failure at one step, delivered as ``StepFailed(reason)``.

    ``launch``: the forward is refused; ``launch`` raises and the slot stays
    free (nothing was enqueued). ``finalize``: ``finalize`` raises.
    ``sampling`` / ``copy``: ``wait`` raises once the copy's time has come.
    For the last three the sampled tokens still land on the device: a fault
    fails its own step only, never a forward already queued behind it.
    """

    kind: str
    reason: str = "injected fault"

    def __attrs_post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
