"""The workload of the exhaustive search: what a request can be, how long a
step can take, and how far the search goes (``Bounds``).

Text requests choose where EOS falls with their first prompt token (the
fake model's rule); the constrained request runs ``Cycle2``, a tiny skill
that alternates two disjoint masks and checks I9 itself. ``expected_tokens``
is what any request must return, computed from the model alone (I8).
"""

from __future__ import annotations

import functools

import attrs

from bubblefree.core import InvariantViolation, Request
from bubblefree.fake_backend import FakeModel, Timing

EOS = 0
VOCAB = 8  # small: the fake model scores every token of the vocabulary per row
EVENS = frozenset(range(0, VOCAB, 2))  # the cycle's first mask holds EOS
ODDS = frozenset(range(1, VOCAB, 2))
DONE_AFTER = 3  # the constrained request's skill is done after this many tokens

# Integer durations keep the virtual timeline exact, so relative times in the
# key compare equal when they are equal.
_BASE = dict(sampling=1.0, launch_cost=1.0, finalize_cost=1.0, commit_cost=0.0,
             commit_cost_per_row=1.0, release_cost=0.0)
TIMINGS: dict[str, Timing] = {
    "fast": Timing(forward=2.0, copy=0.0, **_BASE),
    "slow-forward": Timing(forward=6.0, copy=0.0, **_BASE),
    "slow-copy": Timing(forward=2.0, copy=4.0, **_BASE),
    "slow": Timing(forward=6.0, copy=4.0, **_BASE),
}


@attrs.define(eq=False)
class Cycle2:
    """A tiny skill: masks alternate EVENS, ODDS, ...; done after DONE_AFTER.

    ``advance`` checks I9 itself: the committed token must be allowed by the
    state as it is now, i.e. after the previous commit. A mask built from a
    stale state lets through a token of the other parity."""

    mask_ids: tuple[int, int]
    at: int = 0
    got: tuple[int, ...] = ()  # every token advance received, in order: the world checks it

    def mask_id(self) -> int:
        return self.mask_ids[self.at % 2]

    def advance(self, token: int, value: float | None) -> bool:
        allowed = (EVENS, ODDS)[self.at % 2]
        if token not in allowed:
            raise InvariantViolation(f"I9: token {token} at index {self.at} not allowed by the current state")
        self.at += 1
        self.got += (token,)
        return self.at >= DONE_AFTER


def cycle2_finish(tokens: tuple[int, ...], state: Cycle2 | None) -> tuple:
    """The skill's result assembly, from what the skill itself received: the
    result must carry the committed tokens (skills contract, contracts.md)."""
    return ("cycle2", tokens if state is None else state.got)


@attrs.frozen
class Cycle2Factory:
    mask_ids: tuple[int, int]

    def __call__(self) -> Cycle2:
        return Cycle2(self.mask_ids)


@functools.lru_cache(maxsize=256)
def expected_tokens(model: FakeModel, request: Request) -> tuple[int, ...]:
    """What the request must return, computed from the model alone (I8)."""
    if request.decode_state is None:
        return model.generate(request.prompt, request.max_tokens, request.sampling, request.stop_ids)
    out: list[int] = []
    prev, position = request.prompt[-1], len(request.prompt)
    while len(out) < request.max_tokens:
        prev = model.pick(request.prompt, position, prev, request.sampling, (EVENS, ODDS)[len(out) % 2])
        out.append(prev)
        if prev in request.stop_ids or len(out) >= DONE_AFTER:
            break
        position += 1
    return tuple(out)


@attrs.frozen
class Bounds:
    """How far the search goes. ``eos``: where each text request's EOS falls
    (0 = never, so it ends at the length cap)."""

    requests: int = 3
    max_tokens: int = 4
    last_arrival: int = 2  # every request arrives at a tick in 0..last_arrival
    cancels: int = 1  # cancels per path
    listener_cancels: bool = False  # also cancel from a token listener, inside the commit
    faults: tuple[str, ...] = ()  # device fault kinds to inject, at most one per path
    eos: tuple[int, ...] = (0, 1, 2, 3, 4)
    constrained: bool = True
    timings: tuple[str, ...] = tuple(TIMINGS)
    num_pages: int = 8  # two text requests' pages fit; a third fits only beside the constrained one
    page_size: int = 2
    adapter_eos: tuple[int, ...] = (0,)  # text requests with these EOS positions name an adapter
    adapter_slots: int = 1  # so two such requests contend for it
    max_rows: int = 2
    max_prefill_tokens: int = 4
    max_ticks: int = 60  # a path longer than this is a livelock

    def contents(self, mask_ids: tuple[int, int]) -> tuple[Request, ...]:
        texts = [Request(prompt=(k, 6), max_tokens=self.max_tokens, stop_ids={EOS}, tag=f"eos{k}",
                         adapter="a" if k in self.adapter_eos else None)
                 for k in self.eos]
        if self.constrained:
            # A one-token prompt: one KV page fewer, so whether a third request
            # waits for pages depends on which requests arrived.
            texts.append(Request(prompt=(0,), max_tokens=self.max_tokens, stop_ids={EOS},
                                 decode_state=Cycle2Factory(mask_ids), finisher=cycle2_finish, tag="cycle2"))
        return tuple(texts)
