"""A drawn step with a cut, sampled around the sort in two kernels (Triton,
CUDA), for ``KernelConfig.cut_kernel``.

``sampling.sample_tokens`` cuts a drawn row in torch: gather its mask,
fill what it forbids, scale by the temperature, sort, then a softmax over
the sorted row, a cumulative sum, comparisons for top_k, top_p and min_p,
a scatter of the dropped set back to vocabulary order, the noise, a fill
and the argmax: some twenty passes over the vocabulary besides the sort.
Here:

- ``_scale_kernel`` writes each row's masked logits scaled by its
  temperature (a greedy row's unscaled), the sort's input, and for each
  chunk of ``SCALE_BLOCK`` of them their largest and the sum of their
  exponentials relative to it;
- torch's stable sort, descending;
- ``_cut_kernel``, one program a row, walks the sorted row from its most
  likely token to the first rank a cut drops: past ``top_k``, under
  ``min_p`` of the best's probability, or where the mass of the tokens
  before it reaches ``top_p``. Each kept token's score is its scaled
  logit plus its noise (``gumbel.noise_at`` of its id: the noise
  ``gumbel.noise`` and the one-kernel draw add), and the best score
  wins, ties to the lowest id. It writes the token where the greedy
  kernel writes one (``sampled``, ``last_token`` at the row's slot, the
  flag cleared there). A greedy row takes its sort's first token: the
  lowest id among its best logits, ``torch.argmax``'s.

The kept set is a prefix of the sorted row, as torch's is, with the same
cuts; what differs is rounding. The softmax's denominator is the chunks'
sums, each scaled to the row's best, added in one fixed reduction (with a
``top_k``: the kept ranks' exponentials, a block of ``BLOCK`` at a time);
the mass before a rank is the walk's running sum; and the nucleus ends at
the *first* rank whose mass before it reaches ``top_p`` (torch's path
drops every rank whose does: the same set while its cumulative sum never
falls, which rounding does not promise). So a row whose nucleus ends
within a rounding of ``top_p`` may keep one token more or less than
torch's path keeps. It keeps the same in every bucket: each row's sums
are its own programs', in the same order whatever rows are beside it, so
a row's draw never depends on its batch (I8). A row without a cut keeps
every allowed token and draws what the one-kernel draw draws.

The walk reads only the head of a sorted row. It stops at the first
dropped rank (a nucleus of a few hundred tokens is one block of the
151,936 a Qwen2 row sorts), or at the first rank whose scaled logit plus
the largest noise there is is under the best score so far (no rank at or
after it can win). With a ``top_k`` the denominator's blocks stop once
what is left, each term at most the next rank's, could not change the sum
(every remaining block's sum under half a unit in its last place: the
same float as adding them all).
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.gumbel import noise_at, row_key
from bubblefree.cuda_backend.pdl import tl, triton
from bubblefree.cuda_backend.sampling import PARTS

if triton is not None:
    from triton.language.extra import libdevice  # CUDA's expf, as torch's softmax uses

# Logits a program of ``_scale_kernel`` scales: the denominator's chunks
# (a part of the rule: another width would round it otherwise).
SCALE_BLOCK = 4096
# Ranks ``_cut_kernel`` reads at a time, in ``WARPS`` warps: the blocks of
# the mass before a rank and of a top_k's denominator (a part of the rule too).
BLOCK = 2048
WARPS = 8
# What is left of a top_k's denominator may be dropped once it is under
# this share of the sum: half a unit in its last place is over 2**-25 of
# it, and the factor of two more covers the rounding of the bound itself.
NEGLIGIBLE = 2.0 ** -26
# Over the largest noise ``gumbel.noise_at`` gives (-log(-log(u)) at the
# largest uniform, 1 - 2**-24: 16.6355).
NOISE_MAX = 16.75
NO_RANK = 2147483647  # past every rank: no cut in a block


if triton is not None:

    @triton.jit
    def _scale_kernel(logits_ptr, table_ptr, inputs_ptr, out_ptr, max_ptr, sum_ptr, V, sl_m, st_m,
                      bw, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(logits_ptr + row * sl_m + cols, mask=ok, other=-float("inf")).to(tl.float32)
        mask_id = tl.load(inputs_ptr + bw + row)
        allowed = tl.load(table_ptr + mask_id * st_m + cols, mask=ok, other=0)
        x = tl.where(allowed != 0, x, -float("inf"))
        t = tl.load(inputs_ptr + 6 * bw + row).to(tl.float64, bitcast=True).to(tl.float32)
        if t > 0:  # sampling.sample_tokens' scaled logits; a greedy row's stay as they are
            x = tl.math.div_rn(x, tl.maximum(t, 1e-5))
        tl.store(out_ptr + row * V + cols, x, mask=ok)
        best = tl.max(x, 0)
        total = tl.sum(libdevice.exp(x - best), 0)
        tl.store(max_ptr + row * CHUNKS + c, best)
        tl.store(sum_ptr + row * CHUNKS + c, tl.where(best > -float("inf"), total, 0.0))

    @triton.jit
    def _cut_kernel(ordered_ptr, order_ptr, max_ptr, sum_ptr, inputs_ptr, out_ptr, last_ptr,
                    flag_ptr, V, chunks, bw, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                    NEGLIGIBLE: tl.constexpr, NOISE_MAX: tl.constexpr, NO_RANK: tl.constexpr,
                    FLAG: tl.constexpr):
        row = tl.program_id(0)
        at = row * V  # the row's first rank in ``ordered`` and ``order`` ([b, V] each)
        slot = tl.load(inputs_ptr + row)
        t = tl.load(inputs_ptr + 6 * bw + row).to(tl.float64, bitcast=True).to(tl.float32)
        m = tl.load(ordered_ptr + at)  # the row's best scaled logit
        token = tl.load(order_ptr + at).to(tl.int32)  # greedy: the lowest id among the best
        if t > 0:
            token = token * 0  # every token forbidden: torch.argmax's token of an all -inf row
        if (t > 0) & (m > -float("inf")):
            k = tl.load(inputs_ptr + 5 * bw + row)
            ranks = tl.where((k > 0) & (k < V), k, V).to(tl.int32)  # those top_k leaves
            top_p = tl.load(inputs_ptr + 7 * bw + row).to(tl.float64, bitcast=True).to(tl.float32)
            top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # 1 keeps all, rounding or not
            min_p = tl.load(inputs_ptr + 8 * bw + row).to(tl.float64, bitcast=True).to(tl.float32)
            key = row_key(tl.load(inputs_ptr + 2 * bw + row), tl.load(inputs_ptr + 3 * bw + row),
                          tl.load(inputs_ptr + 4 * bw + row))
            offs = tl.arange(0, BLOCK)
            if ranks == V:  # the denominator from the scale kernel's chunks
                ci = tl.arange(0, CHUNKS)
                there = ci < chunks
                cm = tl.load(max_ptr + row * CHUNKS + ci, mask=there, other=-float("inf"))
                cs = tl.load(sum_ptr + row * CHUNKS + ci, mask=there, other=0.0)
                z = tl.sum(tl.where(cm > -float("inf"), cs * libdevice.exp(cm - m), 0.0), 0)
            else:  # over the top k alone, a block at a time, until the rest cannot change it
                z = 0.0
                start = 0
                more = start < ranks
                while more:
                    r = start + offs
                    x = tl.load(ordered_ptr + at + r, mask=r < ranks, other=-float("inf"))
                    z += tl.sum(libdevice.exp(x - m), 0)
                    start += BLOCK
                    nxt = tl.load(ordered_ptr + at + start, mask=start < ranks,
                                  other=-float("inf"))
                    left = (ranks - start).to(tl.float32) * libdevice.exp(nxt - m)
                    more = (start < ranks) & (left >= z * NEGLIGIBLE)
            best_p = tl.math.div_rn(1.0, z)  # the best's probability
            # The walk: each kept rank's score, to the first rank a cut drops
            # or the first whose logit plus the largest noise cannot win.
            best = -float("inf")
            drawn = token + V  # no rank yet
            before = 0.0  # the mass of the ranks before the block
            start = 0
            more = start < ranks
            while more:
                r = start + offs
                x = tl.load(ordered_ptr + at + r, mask=r < ranks, other=-float("inf"))
                probs = tl.math.div_rn(libdevice.exp(x - m), z)
                ahead = before + tl.cumsum(probs, 0) - probs  # the mass before each rank
                cut = (r >= ranks) | (probs < min_p * best_p) | (ahead >= top_p)
                end = tl.min(tl.where(cut, r, NO_RANK), 0)  # the first rank dropped
                kept = r < end
                ids = tl.load(order_ptr + at + r, mask=kept, other=0).to(tl.int32)
                score = tl.where(kept, x + noise_at(key, ids), -float("inf"))
                top = tl.max(score, 0)
                first = tl.min(tl.where(kept & (score == top), ids, V), 0)
                if (top > best) | ((top == best) & (first < drawn)):
                    best = top
                    drawn = first
                before += tl.sum(probs, 0)
                start += BLOCK
                nxt = tl.load(ordered_ptr + at + start, mask=start < ranks, other=-float("inf"))
                more = (end == NO_RANK) & (start < ranks) & (nxt + NOISE_MAX >= best)
            token = tl.where(drawn < V, drawn, token)  # the best rank is kept, its score finite
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.store(last_ptr + slot, token.to(tl.int64))
        if FLAG:
            tl.store(flag_ptr + slot, 0)


class CutSampler:
    """Sampling of a step with a cut (``sampling.Draw.CUT``) in two kernels
    around torch's sort, for rows of ``vocab_size`` logits: the greedy
    kernel's contract (``greedy_sample.torch_greedy``), drawn rows as
    ``sampling.sample_tokens`` draws them with ``gumbel``'s noise, to the
    rounding the module's doc describes."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.chunks = max(1, -(-vocab_size // SCALE_BLOCK))
        self.width = max(2, triton.next_power_of_2(self.chunks))

    def __call__(self, logits: torch.Tensor, table: torch.Tensor, inputs: torch.Tensor, b: int,
                 sampled: torch.Tensor, last_token: torch.Tensor,
                 flags: torch.Tensor | None = None) -> None:
        v = self.vocab_size
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.shape[1] != v \
                or not table.is_contiguous():
            raise ValueError(f"cut sampler: float32 logits of {v} columns with unit column "
                             "stride and a contiguous mask table")
        if inputs.shape[0] < PARTS * b:
            raise ValueError(f"cut sampler: a drawn step reads {PARTS} parts of {b}")
        table8 = table.view(torch.uint8)  # bool storage, one byte a token
        device = logits.device
        scaled = torch.empty((b, v), dtype=torch.float32, device=device)
        maxes = torch.empty((b, self.width), dtype=torch.float32, device=device)
        sums = torch.empty((b, self.width), dtype=torch.float32, device=device)
        _scale_kernel[(b, self.chunks)](
            logits, table8, inputs, scaled, maxes, sums, v, logits.stride(0), table8.stride(0), b,
            BLOCK=SCALE_BLOCK, CHUNKS=self.width, num_warps=4)
        # Most likely first, ties in id order: a greedy row's first is torch.argmax's.
        ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        _cut_kernel[(b,)](
            ordered, order, maxes, sums, inputs, sampled, last_token,
            flags.view(torch.uint8) if flags is not None else sampled, v, self.chunks, b,
            BLOCK=BLOCK, CHUNKS=self.width, NEGLIGIBLE=NEGLIGIBLE, NOISE_MAX=NOISE_MAX,
            NO_RANK=NO_RANK, FLAG=flags is not None, num_warps=WARPS)


def make_cut_sampler(vocab_size: int, device: torch.device) -> CutSampler | None:
    """The kernels where they run (CUDA with Triton), else None (torch's path)."""
    if triton is None or torch.device(device).type != "cuda":
        return None
    return CutSampler(vocab_size)
