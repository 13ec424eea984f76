"""The workload of the exhaustive search: what a request can be, how long a
step can take, and how far the search goes (``Bounds``).

Text requests choose where EOS falls with their first prompt token (the
fake model's rule); some carry an image (an IMAGE_PREFILL of its prefix,
then a one-token prompt). The constrained request runs ``Cycle2``, a tiny
skill that alternates two disjoint masks and checks I9 itself, and asks a
coordinate, then a size, then no value (I13). ``expected`` is what any
request must return, tokens and values, computed from the model alone (I8).
"""

from __future__ import annotations

import functools

import attrs

from bubblefree.core import ImageRef, InvariantViolation, PromptValue, Request, ValueKind
from bubblefree.fake_backend import FakeModel, Timing
from bubblefree.fake_backend.model import Expected

EOS = 0
VOCAB = 8  # small: the fake model scores every token of the vocabulary per row
EVENS = frozenset(range(0, VOCAB, 2))  # the cycle's first mask holds EOS
ODDS = frozenset(range(1, VOCAB, 2))
DONE_AFTER = 3  # the constrained request's skill is done after this many tokens
VALUES = (ValueKind.COORD, ValueKind.SIZE, None)  # what it asks beside each token, in turn
IMAGE_LENGTH = 2  # KV positions of an image's prefix: one page, then the prompt's

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
    values: bool = False  # ask VALUES in turn
    at: int = 0
    got: tuple[int, ...] = ()  # every token advance received, in order: the world checks it
    got_values: tuple = ()  # and every value

    def mask_id(self) -> int:
        return self.mask_ids[self.at % 2]

    def value_kind(self) -> ValueKind | None:
        return VALUES[self.at % len(VALUES)] if self.values else None

    def advance(self, token: int, value) -> bool:
        allowed = (EVENS, ODDS)[self.at % 2]
        if token not in allowed:
            raise InvariantViolation(f"I9: token {token} at index {self.at} not allowed by the current state")
        if (value is None) is not (self.value_kind() is None):
            raise InvariantViolation(f"I13: value {value!r} at index {self.at}, asked {self.value_kind()}")
        self.at += 1
        self.got += (token,)
        self.got_values += (value,)
        return self.at >= DONE_AFTER


def cycle2_finish(tokens: tuple[int, ...], state: Cycle2 | None) -> tuple:
    """The skill's result assembly, from what the skill itself received: the
    result must carry the committed tokens and their values (skills
    contract, contracts.md). No state: it was never admitted."""
    return ("cycle2", tokens, ()) if state is None else ("cycle2", state.got, state.got_values)


@attrs.frozen
class Cycle2Factory:
    mask_ids: tuple[int, int]
    values: bool = False

    def __call__(self) -> Cycle2:
        return Cycle2(self.mask_ids, self.values)


@functools.lru_cache(maxsize=256)
def expected(model: FakeModel, request: Request) -> Expected:
    """What the request must return, tokens and values, computed from the
    model alone (I8): after its image, under its skill's masks and values."""
    state = masks = None
    if request.decode_state is not None:
        state = request.decode_state()
        masks = dict(zip(state.mask_ids, (EVENS, ODDS)))
    return model.expect(request.prompt, request.max_tokens, request.sampling, request.stop_ids,
                        image=request.image, state=state, masks=masks, prompt_values=request.prompt_values)


def expected_tokens(model: FakeModel, request: Request) -> tuple[int, ...]:
    return expected(model, request).tokens


@attrs.frozen
class Bounds:
    """How far the search goes. ``eos``: where each text request's EOS falls
    (0 = never, so it ends at the length cap)."""

    requests: int = 3
    max_tokens: int = 4
    image_eos: tuple[int, ...] = (2,)  # text requests with these EOS positions carry an image
    values: bool = True  # the constrained request asks values
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

    @property
    def max_context(self) -> int:
        """The longest request: an image's prefix and the prompt, then the output."""
        return (IMAGE_LENGTH if self.image_eos else 0) + 2 + self.max_tokens

    def contents(self, mask_ids: tuple[int, int]) -> tuple[Request, ...]:
        # An image request is a text request with an image before its prompt:
        # one KV page more, so it contends for pages harder.
        # With values, its second prompt position is a spatial reference: the
        # forward reads the value's encoding there, not the token.
        refs = (PromptValue(1, ValueKind.COORD, 0.375),) if self.values else ()
        texts = [Request(prompt=(k, 6), image=ImageRef(IMAGE_LENGTH, source=0x1A6E + k), max_tokens=self.max_tokens,
                         stop_ids={EOS}, tag=f"image-eos{k}", prompt_values=refs)
                 if k in self.image_eos else
                 Request(prompt=(k, 6), max_tokens=self.max_tokens, stop_ids={EOS}, tag=f"eos{k}",
                         adapter="a" if k in self.adapter_eos else None)
                 for k in self.eos]
        if self.constrained:
            # A one-token prompt: one KV page fewer, so whether a third request
            # waits for pages depends on which requests arrived.
            texts.append(Request(prompt=(0,), max_tokens=self.max_tokens, stop_ids={EOS},
                                 decode_state=Cycle2Factory(mask_ids, self.values), finisher=cycle2_finish,
                                 tag="cycle2"))
        return tuple(texts)
