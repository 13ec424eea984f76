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

A step whose drawn rows have no cut (``sampling.Draw.PLAIN``) runs the
same kernel where ``KernelConfig.draw_kernel`` says: a drawn row's logits
are scaled by its temperature and given its Gumbel noise (``gumbel``)
before the argmax, so the step samples in one launch where torch's path
runs some thirty kernels over the vocabulary.

Ties go to the lowest token id, as ``torch.argmax``'s do; a row whose every
logit is forbidden (or -inf) takes token 0, as there. Logits are finite or
-inf (a NaN logit is a broken model; ``torch.argmax`` would pick it, this
kernel need not). ``torch_greedy`` is the same in torch: the reference,
and what runs where Triton does not.

The same kernel samples *ahead* (``GreedySampler.ahead``, ``torch_ahead``):
at the end of a decode forward's graph, unmasked, from the forward's own
logits, into the row of ``sampled`` of the slot the device's metadata
names (one graph serves both slots). What ``last_token`` and the flags
held at the rows' slots before is kept, so the backend can undo it in
the one order where a later step must not see it (``CudaBackend``).
After a forward of dependent launches (``pdl``) it is launched dependent
too: each program reads what no kernel of the step writes (the row's
slot, the step's slot, what ``last_token`` and the flag hold there) while
the head still runs, then waits for the logits (``pdl.enter``).
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.gumbel import noise_at, row_key
from bubblefree.cuda_backend.pdl import enter, launch_options, tl, triton
from bubblefree.cuda_backend.sampling import PARTS

BLOCK = 4096  # logits a program reads: 16 KB of float32 and 4 KB of mask


if triton is not None:

    @triton.jit
    def _greedy_kernel(logits_ptr, table_ptr, slots_ptr, masks_ptr, out_ptr, at_slot_ptr, undo_ptr,
                       last_ptr, flag_ptr, best_ptr, at_ptr, cnt_ptr, V, sl_m, st_m, out_m, chunks,
                       draws_ptr, bw,
                       BLOCK: tl.constexpr, CHUNKS: tl.constexpr, FLAG: tl.constexpr,
                       MASKED: tl.constexpr, AHEAD: tl.constexpr, PDL: tl.constexpr,
                       DRAW: tl.constexpr = False):
        row = tl.program_id(0)
        c = tl.program_id(1)
        # Before the wait: what no kernel of the step writes (the kernel's own
        # stores to last_token and the flags come after every program's wait).
        slot = tl.load(slots_ptr + row)
        if AHEAD:
            k = tl.load(at_slot_ptr)
            held = tl.load(last_ptr + slot)
            if FLAG:
                held_flag = tl.load(flag_ptr + slot).to(tl.int64)
        enter(PDL)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(logits_ptr + row * sl_m + cols, mask=ok, other=-float("inf")).to(tl.float32)
        if MASKED:
            mask_id = tl.load(masks_ptr + row)
            allowed = tl.load(table_ptr + mask_id * st_m + cols, mask=ok, other=0)
            x = tl.where(allowed != 0, x, -float("inf"))
        if DRAW:  # a drawn row: its scaled logits plus its noise, as sampling.sample_tokens adds them
            at_row = draws_ptr + row  # pack_sampling's parts from the seed's low half, ``bw`` apart
            t = tl.load(at_row + 4 * bw).to(tl.float64, bitcast=True).to(tl.float32)
            if t > 0:
                key = row_key(tl.load(at_row), tl.load(at_row + bw), tl.load(at_row + 2 * bw))
                x = tl.math.div_rn(x, tl.maximum(t, 1e-5)) + noise_at(key, cols)
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
            out = out_ptr + row
            if AHEAD:  # the step's slot from the device; what the row slot held, kept to undo
                out = out_ptr + k * out_m + row
                undo = undo_ptr + k * 2 * out_m + row
                tl.store(undo, held)
                if FLAG:
                    tl.store(undo + out_m, held_flag)
            tl.store(out, token)
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


def torch_ahead(logits: torch.Tensor, row_slots: torch.Tensor, at_slot: torch.Tensor,
                sampled: torch.Tensor, undo: torch.Tensor, last_token: torch.Tensor,
                flags: torch.Tensor | None = None) -> None:
    """Greedy sampling ahead, in torch (``GreedySampler.ahead``'s contract):
    the unmasked argmax of each of the ``b = len(row_slots)`` rows of
    ``logits`` into ``sampled[at_slot, :b]`` (``sampled`` ``[slots, R]``,
    ``at_slot`` ``[1]`` on the device) and ``last_token`` at its row slot,
    and ``flags`` cleared there; what ``last_token`` and ``flags`` held
    there first into ``undo[at_slot, :b]`` and ``undo[at_slot, R:R + b]``
    (``undo`` ``[slots, 2R]``)."""
    b, r = row_slots.shape[0], sampled.shape[1]
    tokens = logits[:b].argmax(dim=-1)  # [b]: the dtype's order is float32's
    cols = torch.arange(b, device=tokens.device)  # [b]
    undo.view(-1).index_copy_(0, at_slot * 2 * r + cols, last_token.index_select(0, row_slots))
    if flags is not None:
        undo.view(-1).index_copy_(0, at_slot * 2 * r + r + cols,
                                  flags.index_select(0, row_slots).long())
    sampled.view(-1).index_copy_(0, at_slot * r + cols, tokens)
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
                 flags: torch.Tensor | None = None, drawn: bool = False) -> None:
        """``torch_greedy``'s contract, in one launch. ``drawn``: the rows
        drawn as ``sampling.sample_tokens`` draws them without a cut
        (``Draw.PLAIN``; ``inputs`` all of ``pack_sampling``'s parts), with
        ``gumbel``'s noise: each row with a temperature takes the masked
        argmax of its scaled logits plus its noise, the others the masked
        argmax as before."""
        if logits.dtype != torch.float32 or logits.stride(1) != 1 or not table.is_contiguous():
            raise ValueError("greedy kernel: float32 logits with unit column stride and a "
                             "contiguous mask table")
        if drawn and inputs.shape[0] < PARTS * b:
            raise ValueError(f"greedy kernel: a drawn step reads {PARTS} parts of {b}")
        table8 = table.view(torch.uint8)  # bool storage, one byte a token
        self._launch(b, logits, table8, inputs, inputs[b:], sampled, sampled, sampled, last_token,
                     flags, table8.stride(0), 0, masked=True, ahead=False, drawn=drawn)

    def ahead(self, logits: torch.Tensor, row_slots: torch.Tensor, at_slot: torch.Tensor,
              sampled: torch.Tensor, undo: torch.Tensor, last_token: torch.Tensor,
              flags: torch.Tensor | None = None, pdl: bool = False) -> None:
        """``torch_ahead``'s contract, in one launch: logits of any float
        dtype, read as they are (a bfloat16 forward's need no float32 copy).
        ``pdl``: launched dependent on the head (the module's doc)."""
        if logits.stride(1) != 1 or not (sampled.is_contiguous() and undo.is_contiguous()) \
                or undo.shape[1] != 2 * sampled.shape[1]:
            raise ValueError("greedy kernel ahead: logits with unit column stride, contiguous "
                             "sampled [slots, R] and undo [slots, 2R]")
        self._launch(row_slots.shape[0], logits, logits, row_slots, row_slots, sampled, at_slot,
                     undo, last_token, flags, 0, sampled.shape[1], masked=False, ahead=True,
                     pdl=pdl)

    def _launch(self, b, logits, table8, slots, masks, out, at_slot, undo, last_token, flags,
                st_m, out_m, *, masked, ahead, pdl=False, drawn=False):
        _greedy_kernel[(b, self.chunks)](
            logits, table8, slots, masks, out, at_slot, undo, last_token,
            flags.view(torch.uint8) if flags is not None else out,
            self.best, self.at, self.arrived, self.vocab_size, logits.stride(0), st_m, out_m,
            self.chunks, slots[2 * b:] if drawn else slots, b, BLOCK=BLOCK, CHUNKS=self.width,
            FLAG=flags is not None, MASKED=masked, AHEAD=ahead, PDL=pdl, DRAW=drawn, num_warps=4,
            **launch_options(pdl))


def make_sampler(max_rows: int, vocab_size: int, device: torch.device) -> GreedySampler | None:
    """The kernel where it runs (CUDA with Triton), else None (``torch_greedy``)."""
    device = torch.device(device)
    if triton is None or device.type != "cuda":
        return None
    return GreedySampler(max_rows, vocab_size, device)
