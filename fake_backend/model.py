"""The simulated model: next-token scores as a pure function, and sampling.

Scores depend only on (prompt, position, previous token), so a test can
compute every expected output without the backend (``FakeModel.generate``),
and a row's token can never depend on who shares its batch (I8). The noise
for temperature sampling is a stable hash of (seed, position, token): the
same request samples the same tokens in pipelined and blocking mode.

Hashing is an integer mix (splitmix64), never Python's ``hash()``, which is
salted per process for strings and would make runs irreproducible.

The default scores let a test choose where EOS falls with the first prompt
token ``k``: EOS scores top for the ``k``-th generated token (``k >= 1``) and
lowest everywhere else, so ``k == 0`` never ends on its own. The margin is
large enough that temperature sampling obeys the same rule.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Sequence

import attrs

from bubblefree.core.values import GREEDY, SamplingParams

_MASK64 = (1 << 64) - 1
EOS_TOP = 1.0e6  # beats every other score (all in [0, 1)) and any Gumbel noise
EOS_BOTTOM = -1.0e6

ScoreFn = Callable[[tuple[int, ...], int, int], Sequence[float]]
ValueFn = Callable[[tuple[int, ...], int, int], "float | None"]


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit ints with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stable_hash(*parts: int) -> int:
    """A 64-bit hash of a few ints, the same in every process and run."""
    h = 0x5851F42D4C957F2D
    for p in parts:
        h = _mix(h ^ (p & _MASK64))
    return h


@functools.lru_cache(maxsize=4096)
def _prompt_digest(prompt: tuple[int, ...]) -> int:
    # Cached: a decode row re-derives its prompt from the KV every step.
    return stable_hash(len(prompt), *prompt)


def _unit_open(h: int) -> float:
    """A float strictly inside (0, 1) from the top 53 bits of ``h``."""
    return ((h >> 11) + 0.5) * (1.0 / (1 << 53))


def gumbel(seed: int, position: int, token: int) -> float:
    return -math.log(-math.log(_unit_open(stable_hash(0x6D, seed, position, token))))


def sample(scores: Sequence[float], allowed: Iterable[int] | None,
           sampling: SamplingParams, position: int) -> int:
    """Pick one token among ``allowed`` (all when None); ties go to the lowest id.

    Greedy takes the best score. With temperature, Gumbel-max over the top-p
    nucleus of the allowed tokens: ``argmax(score / T + g(seed, position, token))``
    draws exactly from the softmax, deterministically.
    """
    candidates = range(len(scores)) if allowed is None else sorted(allowed)
    if sampling.temperature == 0.0:
        return min(candidates, key=lambda v: (-scores[v], v))
    temp = sampling.temperature
    ranked = sorted(candidates, key=lambda v: (-scores[v], v))
    if sampling.top_p < 1.0:
        top = scores[ranked[0]] / temp
        weights = [math.exp(scores[v] / temp - top) for v in ranked]
        budget, acc, kept = sampling.top_p * sum(weights), 0.0, 0
        for w in weights:
            kept += 1
            acc += w
            if acc >= budget:
                break
        ranked = ranked[:kept]
    return max(ranked, key=lambda v: (scores[v] / temp + gumbel(sampling.seed, position, v), -v))


@attrs.frozen
class FakeModel:
    """``score_fn(prompt, position, prev_token)`` overrides the default scores;
    ``value_fn(prompt, position, token)`` adds a spatial value per row (a
    region head); without it ``StepOutput.values`` is None. ``position`` is
    always that of the token being sampled."""

    vocab_size: int = 32
    eos_id: int = 0
    score_fn: ScoreFn | None = None
    value_fn: ValueFn | None = None

    def __attrs_post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id must be in [0, {self.vocab_size}), got {self.eos_id}")

    def scores(self, prompt: tuple[int, ...], position: int, prev_token: int) -> Sequence[float]:
        if self.score_fn is None:
            return self._default_scores(prompt, position, prev_token)
        out = self.score_fn(prompt, position, prev_token)
        if len(out) != self.vocab_size:
            raise ValueError(f"score_fn returned {len(out)} scores for a vocabulary of {self.vocab_size}")
        return out

    def value(self, prompt: tuple[int, ...], position: int, token: int) -> float | None:
        return None if self.value_fn is None else self.value_fn(prompt, position, token)

    def pick(self, prompt: tuple[int, ...], position: int, prev_token: int,
             sampling: SamplingParams = GREEDY, allowed: Iterable[int] | None = None) -> int:
        """The token the backend samples for this row: the reference for tests."""
        return sample(self.scores(prompt, position, prev_token), allowed, sampling, position)

    def generate(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams = GREEDY,
                 stop_ids: Iterable[int] | None = None) -> tuple[int, ...]:
        """Unconstrained output of a request, ending at a stop id (kept) or
        after ``max_tokens``: what the engine must return for it (I8)."""
        prompt = tuple(prompt)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        stop = frozenset((self.eos_id,) if stop_ids is None else stop_ids)
        out: list[int] = []
        prev, position = prompt[-1], len(prompt)
        while len(out) < max_tokens:
            prev = self.pick(prompt, position, prev, sampling)
            out.append(prev)
            if prev in stop:
                break
            position += 1
        return tuple(out)

    def _default_scores(self, prompt: tuple[int, ...], position: int, prev_token: int) -> list[float]:
        base = stable_hash(_prompt_digest(prompt), position, prev_token)
        out = [(stable_hash(base, v) >> 11) * (1.0 / (1 << 53)) for v in range(self.vocab_size)]
        generated_before = position - len(prompt)
        eos_now = prompt[0] >= 1 and generated_before == prompt[0] - 1
        out[self.eos_id] = EOS_TOP if eos_now else EOS_BOTTOM
        return out
