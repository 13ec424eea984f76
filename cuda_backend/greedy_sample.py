"""Greedy sampling as one kernel (Triton, CUDA).

A greedy step's sampling in torch is seven kernels: gather each row's mask
from the table, invert it, fill the logits it forbids, argmax (one
13.7-us reduction over a row's 51,200 logits on the H200), the copy into
the slot's ``sampled``, the scatter into ``last_token`` at the rows' row
slots, and on moondream the clearing of the rows' value flags. Each is a
launch and a tail between two decode steps. Here one kernel does all of
it: programs of ``BLOCK`` logits each find their chunk's best allowed
token, and the last program of a row to finish (an arrival counter, reset
by that program for the next launch) picks the row's token among the
chunks' and writes it everywhere it goes.

Ties go to the lowest token id, as ``torch.argmax``'s do; a row whose every
logit is forbidden (or -inf) takes token 0, as there. Logits are finite or
-inf (a NaN logit is a broken model; ``torch.argmax`` would pick it, this
kernel need not). ``torch_greedy`` is the same in torch: the reference,
and what runs where Triton does not.
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.pdl import tl, triton

BLOCK = 4096  # logits a program reads: 16 KB of float32 and 4 KB of mask


if triton is not None:

    @triton.jit
    def _greedy_kernel(logits_ptr, table_ptr, inputs_ptr, out_ptr, last_ptr, flag_ptr,
                       best_ptr, at_ptr, cnt_ptr, b, V, sl_m, st_m, chunks,
                       BLOCK: tl.constexpr, CHUNKS: tl.constexpr, FLAG: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        mask_id = tl.load(inputs_ptr + b + row)  # pack_sampling's layout: row slots, then mask ids
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(logits_ptr + row * sl_m + cols, mask=ok, other=-float("inf"))
        allowed = tl.load(table_ptr + mask_id * st_m + cols, mask=ok, other=0)
        x = tl.where(allowed != 0, x, -float("inf"))
        best = tl.max(x, 0)
        at = tl.min(tl.where(ok & (x == best), cols, V), 0)  # the lowest id of the best
        tl.store(best_ptr + row * CHUNKS + c, best)
        tl.store(at_ptr + row * CHUNKS + c, at)
        tl.debug_barrier()  # the program's stores all made before it counts itself in
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == chunks - 1:
            tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")
            ci = tl.arange(0, CHUNKS)
            there = ci < chunks
            bests = tl.load(best_ptr + row * CHUNKS + ci, mask=there, other=-float("inf"),
                            cache_modifier=".cg")  # other programs' stores: past L1
            ats = tl.load(at_ptr + row * CHUNKS + ci, mask=there, other=V, cache_modifier=".cg")
            top = tl.max(bests, 0)
            # Chunks hold ascending ids: the lowest id among the best chunks is the row's.
            token = tl.min(tl.where(there & (bests == top), ats, V), 0)
            token = tl.where(token == V, 0, token).to(tl.int64)  # unreachable unless V == 0
            tl.store(out_ptr + row, token)
            slot = tl.load(inputs_ptr + row)
            tl.store(last_ptr + slot, token)
            if FLAG:
                tl.store(flag_ptr + slot, 0)


def torch_greedy(logits: torch.Tensor, table: torch.Tensor, inputs: torch.Tensor, b: int,
                 sampled: torch.Tensor, last_token: torch.Tensor,
                 flags: torch.Tensor | None = None) -> None:
    """The kernel's work in torch: ``inputs`` in ``sampling.pack_sampling``'s
    layout for bucket ``b`` (row slots ``[:b]``, mask ids ``[b:2b]``);
    each row's masked argmax into ``sampled[:b]`` and ``last_token`` at its
    row slot, and ``flags`` (if given) cleared there."""
    row_slots, mask_ids = inputs[:b], inputs[b:2 * b]
    masked = logits[:b].masked_fill(~table.index_select(0, mask_ids), float("-inf"))
    tokens = masked.argmax(dim=-1)  # [b]
    sampled[:b].copy_(tokens)
    last_token.index_copy_(0, row_slots, tokens)
    if flags is not None:
        flags.index_fill_(0, row_slots, False)


class GreedySampler:
    """The kernel's scratch (each chunk's best logit and token per row, and
    a row's arrival counter) for up to ``max_rows`` rows of ``vocab_size``
    logits. One per backend: samplings run one after another on the
    compute stream, so they never share it at once."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.chunks = max(1, -(-vocab_size // BLOCK))
        self.width = max(2, triton.next_power_of_2(self.chunks)) if triton is not None \
            else self.chunks
        self.best = torch.empty(max_rows, self.width, dtype=torch.float32, device=device)
        self.at = torch.empty(max_rows, self.width, dtype=torch.int32, device=device)
        self.arrived = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def __call__(self, logits: torch.Tensor, table: torch.Tensor, inputs: torch.Tensor, b: int,
                 sampled: torch.Tensor, last_token: torch.Tensor,
                 flags: torch.Tensor | None = None) -> None:
        """``torch_greedy``'s contract, in one launch."""
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or not table.is_contiguous():
            raise ValueError("greedy kernel: float32 logits with unit column stride and a "
                             "contiguous mask table")
        table8 = table.view(torch.uint8)  # bool storage, one byte a token
        _greedy_kernel[(b, self.chunks)](
            logits, table8, inputs, sampled, last_token,
            flags.view(torch.uint8) if flags is not None else sampled,
            self.best, self.at, self.arrived, b, self.vocab_size, logits.stride(0),
            table8.stride(0), self.chunks,
            BLOCK=BLOCK, CHUNKS=self.width, FLAG=flags is not None, num_warps=4)


def make_sampler(max_rows: int, vocab_size: int, device: torch.device) -> GreedySampler | None:
    """The kernel where it runs (CUDA with Triton), else None (``torch_greedy``)."""
    device = torch.device(device)
    if triton is None or device.type != "cuda":
        return None
    return GreedySampler(max_rows, vocab_size, device)
