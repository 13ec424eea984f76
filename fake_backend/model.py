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

An image request's "prompt" here is its whole prefix: the image's markers
(``images.py``), then the prompt tokens; the EOS rule reads the first prompt
token. A value (a region head's coordinate or size) is a pure function of
the same context, and the row's next input is a marker of it, not its token.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs

from bubblefree.core.values import GREEDY, ImageRef, SamplingParams, ValueKind
from bubblefree.fake_backend.hashing import stable_hash
from bubblefree.fake_backend.images import fingerprint, image_markers, value_marker, with_values

__all__ = ["EOS_BOTTOM", "EOS_TOP", "Expected", "FakeModel", "gumbel", "sample", "stable_hash"]

EOS_TOP = 1.0e6  # beats every other score (all in [0, 1)) and any Gumbel noise
EOS_BOTTOM = -1.0e6

ScoreFn = Callable[[tuple[int, ...], int, int], Sequence[float]]
ValueFn = Callable[[tuple[int, ...], int, int, ValueKind], Any]
Value = float | tuple[float, float]
COORD_BINS = SIZE_BINS = 1024


@functools.lru_cache(maxsize=4096)
def _prompt_digest(prompt: tuple[int, ...]) -> int:
    # Cached: a decode row re-derives its prompt from the KV every step.
    return stable_hash(len(prompt), *prompt)


@functools.lru_cache(maxsize=4096)
def _first_text(prompt: tuple[int, ...]) -> int:
    """The first prompt token after an image's markers (negative)."""
    return next((t for t in prompt if t >= 0), 0)


def _unit_open(h: int) -> float:
    """A float strictly inside (0, 1) from the top 53 bits of ``h``."""
    return ((h >> 11) + 0.5) * (1.0 / (1 << 53))


def gumbel(seed: int, position: int, token: int) -> float:
    return -math.log(-math.log(_unit_open(stable_hash(0x6D, seed, position, token))))


def sample(scores: Sequence[float], allowed: Iterable[int] | None,
           sampling: SamplingParams, position: int) -> int:
    """Pick one token among ``allowed`` (all when None); ties go to the lowest id.

    Greedy takes the best score. With temperature, Gumbel-max over the allowed
    tokens left by ``top_k``, then the ``top_p`` nucleus of those, then
    ``min_p`` (``SamplingParams``' order): ``argmax(score / T + g(seed,
    position, token))`` draws exactly from the softmax, deterministically.
    """
    candidates = range(len(scores)) if allowed is None else sorted(allowed)
    if sampling.temperature == 0.0:
        return min(candidates, key=lambda v: (-scores[v], v))
    temp = sampling.temperature
    ranked = sorted(candidates, key=lambda v: (-scores[v], v))
    if sampling.top_k:
        ranked = ranked[:sampling.top_k]
    if sampling.top_p == 1.0 and not sampling.min_p:
        return _drawn(ranked, scores, sampling, position)
    top = scores[ranked[0]] / temp
    weights = [math.exp(scores[v] / temp - top) for v in ranked]  # the best's is 1
    if sampling.top_p < 1.0:
        budget, acc, kept = sampling.top_p * sum(weights), 0.0, 0
        for w in weights:
            kept += 1
            acc += w
            if acc >= budget:
                break
        ranked, weights = ranked[:kept], weights[:kept]
    if sampling.min_p:  # a share of the best's probability: the same before or after renormalizing
        ranked = [v for v, w in zip(ranked, weights) if w >= sampling.min_p]
    return _drawn(ranked, scores, sampling, position)


def _drawn(ranked: list[int], scores: Sequence[float], sampling: SamplingParams, position: int) -> int:
    temp = sampling.temperature
    return max(ranked, key=lambda v: (scores[v] / temp + gumbel(sampling.drawn_seed, position, v), -v))


@attrs.frozen
class Expected:
    """What the engine must return for a request: its tokens, and per token
    the value its skill asked for (None where it asked none)."""

    tokens: tuple[int, ...]
    values: tuple[Value | None, ...]


@attrs.frozen
class FakeModel:
    """``score_fn(prompt, position, prev_token)`` overrides the default scores;
    ``value_fn(prompt, position, token, kind)`` the default values (it must
    return one of ``kind``'s shape: a float in [0, 1], or a pair in (0, 1]).
    ``position`` is always that of the token being sampled, ``prompt`` the
    whole prefix (an image's markers first)."""

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

    def value(self, prompt: tuple[int, ...], position: int, prev_token: int, token: int,
              kind: ValueKind, sampling: SamplingParams = GREEDY) -> Value:
        """The value a region head decodes for this row: from the context the
        token was sampled in (the hidden state), not from the token. Bins are
        greedy at temperature 0, else drawn with the request's seed."""
        if self.value_fn is not None:
            return self.value_fn(prompt, position, token, kind)
        base = stable_hash(0x5E, _prompt_digest(prompt), position, prev_token, kind is ValueKind.SIZE)
        if sampling.temperature != 0.0:
            base = stable_hash(0xB1, sampling.drawn_seed, base)
        if kind is ValueKind.COORD:
            return (base % COORD_BINS) / COORD_BINS
        w, h = (stable_hash(base, axis) % SIZE_BINS for axis in (0, 1))
        return 2 ** (w / (SIZE_BINS - 1) * 10 - 10), 2 ** (h / (SIZE_BINS - 1) * 10 - 10)

    def pick(self, prompt: tuple[int, ...], position: int, prev_token: int,
             sampling: SamplingParams = GREEDY, allowed: Iterable[int] | None = None) -> int:
        """The token the backend samples for this row: the reference for tests."""
        return sample(self.scores(prompt, position, prev_token), allowed, sampling, position)

    def generate(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams = GREEDY,
                 stop_ids: Iterable[int] | None = None, **kw: Any) -> tuple[int, ...]:
        """Unconstrained output of a request, ending at a stop id (kept) or
        after ``max_tokens``: what the engine must return for it (I8). Takes
        ``expect``'s keywords (an image, a decode state)."""
        return self.expect(prompt, max_tokens, sampling, stop_ids, **kw).tokens

    def expect(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams = GREEDY,
               stop_ids: Iterable[int] | None = None, *, image: ImageRef | None = None,
               state: Any = None, masks: Mapping[int, frozenset[int]] | None = None,
               prompt_values: tuple = ()) -> Expected:
        """The tokens and values the engine must return, computed without a
        backend: after ``image``'s prefix, under ``state`` (a DecodeState: its
        mask, from ``masks``, and its value kind before each token; ``advance``
        after), ending at a stop id, the state's end, or ``max_tokens``;
        ``prompt_values`` (``PromptValue``s) replace their positions' tokens."""
        text = with_values(tuple(prompt), prompt_values)
        if not text:
            raise ValueError("prompt must hold at least one token")
        full = text if image is None else image_markers(fingerprint(image.source), image.length) + text
        stop = frozenset((self.eos_id,) if stop_ids is None else stop_ids)
        tokens: list[int] = []
        values: list[Value | None] = []
        prev, position = full[-1], len(full)
        while len(tokens) < max_tokens:
            allowed = kind = None
            if state is not None:
                mask = state.mask_id()
                allowed = None if mask is None else masks[mask]
                ask = getattr(state, "value_kind", None)
                kind = None if ask is None else ask()
            token = self.pick(full, position, prev, sampling, allowed)
            value = None if kind is None else self.value(full, position, prev, token, kind, sampling)
            tokens.append(token)
            values.append(value)
            done = state is not None and state.advance(token, value)
            if token in stop or done:
                break
            prev = token if kind is None else value_marker(kind, value)
            position += 1
        return Expected(tuple(tokens), tuple(values))

    def _default_scores(self, prompt: tuple[int, ...], position: int, prev_token: int) -> list[float]:
        base = stable_hash(_prompt_digest(prompt), position, prev_token)
        out = [(stable_hash(base, v) >> 11) * (1.0 / (1 << 53)) for v in range(self.vocab_size)]
        generated_before = position - len(prompt)
        k = _first_text(prompt)
        eos_now = k >= 1 and generated_before == k - 1
        out[self.eos_id] = EOS_TOP if eos_now else EOS_BOTTOM
        return out
