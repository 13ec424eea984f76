"""Sampling on the device: skill masks, greedy, temperature, top-k, top-p, min-p.

Randomness is a pure function of (request seed, position, token id): a
counter-based hash turns it into a uniform, and Gumbel-max picks the token.
There is no generator state shared across rows or steps, so a row's token
depends only on its own logits, seed and position, never on which other
rows share its batch or on how many steps ran before (I8 with sampling on:
pipelined and blocking runs draw the same tokens).

Masks live in a device-resident table ``[num_masks, V]`` (bool); row 0
allows every token and stands for "unconstrained". A step gathers one row
per sequence by id, so building a mask costs no host work per step (the
seed's lesson: one stray host copy here erases the whole pipelining gain).
"""

from __future__ import annotations

import enum
from typing import Callable, NamedTuple

import numpy as np
import torch

from bubblefree.core.protocol import check_mask
from bubblefree.core.values import StepRow

M32 = 0xFFFFFFFF
UNCONSTRAINED = 0  # mask id of the all-true row
# ``pack_sampling``'s layout, a part of ``b`` int64 words each: row slot,
# mask id, seed's low and high halves, position, top_k, then temperature,
# top_p and min_p as float64 bits.
PARTS = 9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)`` held in int64, split
    in 16-bit halves so no intermediate overflows int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (the "lowbias32" mixer)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-token salt ``[V]``, computed once."""
    return mix32(torch.arange(vocab_size, dtype=torch.long, device=device) ^ 0x9E3779B9)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor,
             token_salt: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` uniforms strictly inside (0, 1), a function of (seed,
    position, token) only (``unit`` of their hash)."""
    key = mix32(seed_lo ^ mix32(seed_hi ^ mix32(position & M32)))  # [B]
    return unit(mix32(key.unsqueeze(1) ^ token_salt))  # [B, V]


def unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes as float32 uniforms strictly inside (0, 1): their top 23
    bits, a half step from either end. With 24 bits the largest, ``2**24 -
    0.5``, is not a float32 and rounds up to ``2**24``: u = 1.0, whose
    Gumbel noise is +inf, and a masked token's -inf + inf is NaN, which
    argmax takes (a (row, token) in 2**24: a step in about 340 at a
    vocabulary of 50k)."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


class Draw(enum.Enum):
    """What a step's sampling has to do (``pack_sampling`` says; a graph
    each): every row greedy; a row drawn, none cut (Gumbel-max over the
    scaled logits: no sort of the vocabulary); a row drawn and cut (the
    sort, for top_k, top_p or min_p)."""

    GREEDY = "greedy"
    PLAIN = "plain"
    CUT = "cut"


class Draws(NamedTuple):
    """Each row's sampling values on the device, ``[B]`` each: float32
    ``temperature``, ``top_p``, ``min_p``; int64 ``top_k``, the seed's
    32-bit halves and the sampled token's ``position``."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    position: torch.Tensor


def gumbel_noise(draws: Draws, token_salt: torch.Tensor) -> torch.Tensor:
    """Each row's Gumbel noise ``[B, V]``: ``-log(-log(u))`` of its uniforms."""
    return -torch.log(-torch.log(uniforms(draws.seed_lo, draws.seed_hi, draws.position, token_salt)))


def sample_tokens(logits: torch.Tensor, table: torch.Tensor, mask_ids: torch.Tensor, draws: Draws,
                  token_salt: torch.Tensor, draw: Draw,
                  noise: Callable[[Draws, torch.Tensor], torch.Tensor] = gumbel_noise
                  ) -> torch.Tensor:
    """One token per row ``[B]`` from ``logits`` ``[B, V]`` (float32). A row
    with ``temperature == 0`` takes the argmax; others draw from
    ``softmax(logits / temperature)`` cut as ``SamplingParams`` says: the
    ``top_k`` most likely, the ``top_p`` nucleus of those renormalized,
    then what is under ``min_p`` of the best's probability. Disallowed
    tokens never win. ``draw``: what the rows need (``Draw``); ``PLAIN``
    draws what ``CUT`` draws for rows without a cut. ``noise``: the rows'
    Gumbel noise from ``draws`` and ``token_salt`` (``gumbel_noise``; on
    CUDA, ``gumbel.noise`` computes it in one kernel)."""
    banned = ~table.index_select(0, mask_ids)  # [B, V]
    logits = logits.masked_fill(banned, float("-inf"))
    greedy = logits.argmax(dim=-1)  # [B]
    if draw is Draw.GREEDY:
        return greedy
    temperature = draws.temperature
    scaled = logits / temperature.clamp_min(1e-5).unsqueeze(1)  # [B, V]
    gumbel = noise(draws, token_salt)  # [B, V]
    if draw is Draw.PLAIN:  # nothing dropped: banned tokens are -inf already
        return torch.where(temperature > 0, (scaled + gumbel).argmax(dim=-1), greedy)
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    # Ranks past a row's top_k (0: none) leave before the softmax, which
    # renormalizes what stays for top_p, as vLLM and transformers cut.
    ranks = torch.arange(ordered.shape[1], device=ordered.device)  # [V]
    k = draws.top_k.unsqueeze(1)  # [B, 1]
    past_k = (ranks >= k) & (k > 0)  # [B, V]
    probs = torch.softmax(ordered.masked_fill(past_k, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
    p = draws.top_p.unsqueeze(1)
    drop_sorted = past_k | ((before >= p) & (p < 1.0))  # top_p == 1 keeps all (no rounding losses)
    # min_p against the best's probability: a ratio, the same before or after top_p renormalizes.
    drop_sorted |= probs < draws.min_p.unsqueeze(1) * probs[:, :1]
    drop = drop_sorted.scatter(1, order, drop_sorted)  # back to vocab order [B, V]
    # Masked and dropped tokens out after the noise is added, so no sum of
    # infinities can bring one back.
    drawn = (scaled + gumbel).masked_fill(drop | banned, float("-inf")).argmax(dim=-1)  # [B]
    return torch.where(temperature > 0, drawn, greedy)


def pack_sampling(a: np.ndarray, rows: tuple[StepRow, ...], mask_ids: tuple[int | None, ...],
                  b: int, scratch_row: int) -> Draw:
    """Write a step's sampling inputs for bucket ``b`` into host staging ``a``
    (``PARTS`` parts of ``b``, the module's layout). Padded rows sample into
    the scratch row, unconstrained and greedy. Returns what the rows need
    (``Draw``)."""
    # Each part a column at once: a host-bound step at 64 rows spent 40-70
    # us here writing numpy's elements one at a time. Floats are written
    # through a float64 view of the same buffer (their bits, as the device
    # reads them); seeds are SamplingParams', so in [0, 2**64).
    n = len(rows)
    if len(mask_ids) != n:
        raise ValueError(f"{len(mask_ids)} mask ids for {n} rows")
    samplings = [r.sampling for r in rows]
    seeds = [s.seed or 0 for s in samplings]  # ``SamplingParams.drawn_seed``, without a call a row
    temperatures = [s.temperature for s in samplings]
    floats = a.view(np.float64)
    a[:PARTS * b] = 0  # padding: top_k and min_p 0 (no cut)
    a[:n] = [r.row_slot for r in rows]
    a[n:b] = scratch_row
    a[b:b + n] = [UNCONSTRAINED if m is None else m for m in mask_ids]
    a[2 * b:2 * b + n] = [seed & M32 for seed in seeds]
    a[3 * b:3 * b + n] = [seed >> 32 for seed in seeds]
    a[4 * b:4 * b + n] = [r.position + r.num_tokens for r in rows]  # the sampled token's position
    top_p = [s.top_p for s in samplings]
    floats[6 * b:6 * b + n] = temperatures
    floats[7 * b:7 * b + n] = top_p
    floats[7 * b + n:8 * b] = 1.0
    if not any(temperatures):  # the cuts matter to a drawn row only
        return Draw.GREEDY
    top_k, min_p = [s.top_k for s in samplings], [s.min_p for s in samplings]
    a[5 * b:5 * b + n] = top_k
    floats[8 * b:8 * b + n] = min_p
    # A greedy row's cuts are never read (it takes the argmax): only drawn rows count.
    cut = any(t and (p < 1.0 or k or m) for t, p, k, m in zip(temperatures, top_p, top_k, min_p))
    return Draw.CUT if cut else Draw.PLAIN


def unpack_sampling(inputs: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor, Draws]:
    """``pack_sampling``'s layout on the device, bucket ``b``: the row slots
    and mask ids (int64 ``[b]`` each) and the rows' ``Draws``."""
    row_slots, mask_ids, seed_lo, seed_hi, position, top_k = (inputs[i * b:(i + 1) * b] for i in range(6))
    temperature, top_p, min_p = (inputs[i * b:(i + 1) * b].view(torch.float64).float()
                                 for i in range(6, PARTS))  # [b] each
    return row_slots, mask_ids, Draws(temperature, top_p, top_k, min_p, seed_lo, seed_hi, position)


def sample_inputs(inputs: torch.Tensor, logits: torch.Tensor, table: torch.Tensor,
                  token_salt: torch.Tensor, b: int, draw: Draw,
                  noise: Callable[[Draws, torch.Tensor], torch.Tensor] = gumbel_noise):
    """Unpack ``pack_sampling``'s layout on the device and sample: returns the
    rows' row slots ``[b]`` and tokens ``[b]`` (``noise`` as
    ``sample_tokens`` takes it)."""
    row_slots, mask_ids, draws = unpack_sampling(inputs, b)
    return row_slots, sample_tokens(logits[:b], table, mask_ids, draws, token_salt, draw, noise)


class MaskTable:
    """Allowed-token sets by id, ``table`` ``[capacity, V]`` bool on the device.
    Registration is off the hot path; when the table is full it is
    reallocated at twice the size, and the caller re-captures anything that
    read the old one (``register`` says so)."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 16):
        self.vocab_size, self.device = vocab_size, device
        self.table = torch.ones(max(capacity, 2), vocab_size, dtype=torch.bool, device=device)
        self.count = 1  # row 0: UNCONSTRAINED
        self._ids: dict[frozenset[int], int] = {}

    def register(self, allowed: frozenset[int]) -> tuple[int, bool]:
        """Returns (mask id, whether ``table`` was reallocated)."""
        allowed = frozenset(allowed)
        if allowed in self._ids:
            return self._ids[allowed], False
        allowed = check_mask(allowed, self.vocab_size)
        grew = self.count == self.table.shape[0]
        if grew:
            bigger = torch.ones(2 * self.count, self.vocab_size, dtype=torch.bool,
                                device=self.device)
            bigger[:self.count].copy_(self.table)
            self.table = bigger
        row = torch.zeros(self.vocab_size, dtype=torch.bool)
        row[torch.tensor(sorted(allowed), dtype=torch.long)] = True
        self.table[self.count].copy_(row)
        self._ids[allowed] = mask_id = self.count
        self.count += 1
        return mask_id, grew
