"""Scheduling policy: which sequences a step takes. Pure functions, no state.

The scheduler (``scheduler.py``) keeps the invariants; this module only
chooses, so fairness rules can change without touching I2-I7 code. Both
choices are deterministic in sequence ids, which the replay tests rely on.
"""

from __future__ import annotations

from typing import Iterable

from bubblefree.core.protocol import Capacity
from bubblefree.core.pages import IdPool
from bubblefree.core.sequence import Phase, Sequence
from bubblefree.core.values import StepKind


def choose_step(seqs: Iterable[Sequence], capacity: Capacity,
                last_kind: StepKind | None) -> tuple[StepKind, list[Sequence]] | None:
    """The next step's kind and rows, or None when nothing can run.

    Prefill and decode alternate when both wait, so a stream of arrivals
    cannot starve running sequences and vice versa. A prefill takes admitted
    sequences of the oldest one's kind (image or text) in arrival order
    within the token budget, an image's prefix counted (the first always
    fits: ``submit`` refused longer ones); a decode takes the rows that
    waited longest, up to ``max_rows``, in id order."""
    seqs = list(seqs)
    admitted, running = Phase.ADMITTED, Phase.RUNNING  # looked up once: an enum member's lookup is slow
    prefill = sorted((s for s in seqs if s.phase is admitted), key=lambda s: s.seq_id)
    decode = [s for s in seqs if s.phase is running and s.launched < s.request.max_tokens]
    if prefill and (not decode or last_kind not in PREFILLS):
        kind = prefill_kind(prefill[0])
        chosen, budget = [], capacity.max_prefill_tokens
        for s in (s for s in prefill if prefill_kind(s) is kind):
            n = s.request.prefix_len
            if len(chosen) == capacity.max_rows or (chosen and n > budget):
                break
            chosen.append(s)
            budget -= n
        return kind, chosen
    if decode:
        chosen = sorted(decode, key=lambda s: (s.last_step, s.seq_id))[:capacity.max_rows]
        return StepKind.DECODE, sorted(chosen, key=lambda s: s.seq_id)
    return None


PREFILLS = (StepKind.PREFILL, StepKind.IMAGE_PREFILL)


def prefill_kind(s: Sequence) -> StepKind:
    """A sequence's prefill step kind: image rows and text rows never share one."""
    return StepKind.PREFILL if s.request.image is None else StepKind.IMAGE_PREFILL


def shortfall(pages_needed: int, wants_adapter: bool, pages: IdPool, rows: IdPool,
              adapters: IdPool) -> list[str]:
    """What a queued sequence still waits for ("pages", "rows", "adapters");
    empty when it can be admitted. Admission is FIFO: the head waits until it
    has all of them, and nothing behind it overtakes (no starvation)."""
    return [name for name, ok in (
        ("pages", pages.can_allocate(pages_needed)), ("rows", rows.can_allocate()),
        ("adapters", not wants_adapter or adapters.can_allocate())) if not ok]
