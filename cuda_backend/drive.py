"""Drive a backend with hand-built StepPlans, without the core.

A minimal pipelined loop for tests and benchmarks of the backend alone:
one prefill of every prompt, then decode steps over all rows, each launched
before the previous step is waited for (the seed's order: launch t+1, commit
t, finalize t+1). Pages are handed out scattered (a shuffled permutation),
so nothing can pass by assuming a sequence's pages are contiguous.
"""

from __future__ import annotations

import random

from bubblefree.core.values import GREEDY, SamplePlan, SamplingParams, StepKind, StepPlan, StepRow


def scattered_pages(lengths: list[int], page_size: int, num_pages: int,
                    seed: int = 0) -> list[tuple[int, ...]]:
    """Pages for sequences of ``lengths`` positions, drawn from a shuffle."""
    pool = list(range(num_pages))
    random.Random(seed).shuffle(pool)
    out = []
    for n in lengths:
        k = -(-n // page_size)
        if k > len(pool):
            raise ValueError(f"{num_pages} pages cannot hold sequences of {lengths} positions")
        out.append(tuple(pool[:k]))
        pool = pool[k:]
    return out


def generate(backend, prompts: list[list[int]], max_new: int, *,
             sampling: list[SamplingParams] | None = None, mask_ids: list[int | None] | None = None,
             row_slots: list[int] | None = None, page_seed: int = 0) -> list[list[int]]:
    """``max_new`` tokens per prompt (no stop tokens), pipelined over both slots."""
    cap = backend.capacity
    n = len(prompts)
    sampling = sampling or [GREEDY] * n
    masks = tuple(mask_ids or [None] * n)
    slots_of = row_slots or list(range(n))
    pages = scattered_pages([len(p) + max_new for p in prompts], cap.page_size, cap.num_pages,
                            page_seed)
    rows = [StepRow(seq_id=i, row_slot=slots_of[i], tokens=tuple(p), position=0, pages=pages[i],
                    sampling=sampling[i]) for i, p in enumerate(prompts)]
    backend.launch(0, StepPlan(0, StepKind.PREFILL, tuple(rows)))
    backend.finalize(0, SamplePlan(0, masks))
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(1, max_new + 1):
        if step < max_new:  # launch t+1 before committing t
            rows = [StepRow(seq_id=i, row_slot=slots_of[i], tokens=(), position=len(p) + step - 1,
                            pages=pages[i], sampling=sampling[i]) for i, p in enumerate(prompts)]
            backend.launch(step % 2, StepPlan(step, StepKind.DECODE, tuple(rows)))
        prev = (step - 1) % 2
        result = backend.wait(prev)
        backend.release(prev)
        for i, t in enumerate(result.tokens):
            out[i].append(t)
        if step < max_new:
            backend.finalize(step % 2, SamplePlan(step, masks))
    return out
