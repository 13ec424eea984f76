"""The forward side of a step: metadata packing, and the model
call for decode (graph-capturable) and transformers' padded prefill (eager;
short prefills go through token_prefill.py instead, in graphs).

Host metadata is packed into a DecodeSlot's staging buffer (pinned on CUDA)
and copied to the device with one non-blocking copy per step, so a launch
never waits for the device. Decode metadata lands in one static buffer that
every captured decode graph reads; a graph for bucket (B, P) reads it as
``[slot, 0 | row_slots (B of max_rows) | positions (B of max_rows) |
page_table B*P]``, where ``slot`` is the DecodeSlot the step runs in (a
graph serves both: what it writes per slot it finds through this; the
header is two elements so the parts after it stay 16-byte aligned).
Each part starts at a fixed offset whatever the bucket, so the compiled step
sees the same input layout in every bucket (a bucket-dependent offset would
make torch.compile recompile per bucket). Sharing that buffer between
the two slots is safe because both slots' copies and replays run in launch
order on the one compute stream (I1): step t+1's copy executes only after step
t's forward has read the buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from bubblefree.core.protocol import Capacity
from bubblefree.core.values import StepPlan
from bubblefree.cuda_backend.attention import CONTEXT_KWARG, PagedContext, decode_context, prefill_context
from bubblefree.cuda_backend.fused_decode import make_decoder
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.kv_cache import PagedKVCache
from bubblefree.cuda_backend.sizing import prefill_key_budget
from bubblefree.cuda_backend.step_inputs import step_inputs
from bubblefree.cuda_backend.token_prefill import TokenPrefill


# The decode metadata's header: the step's slot index, then padding.
META_HEAD = 2


def staging_size(cap: Capacity) -> int:
    """int64 elements a slot's host staging needs for any kind of step: the
    largest of the three layouts packed into it."""
    max_pages = -(-cap.max_context // cap.page_size)
    t, r = cap.max_prefill_tokens, cap.max_rows
    return max(META_HEAD + 2 * r + r * max_pages,  # a decode step (``pack_decode``)
               # a padded prefill (``pack_prefill``: four parts a token; four a
               # row, a prefix LM's prefix ends, moondream's rows by kind; pages)
               4 * t + 6 * r + r * max_pages,
               # a prefill as token rows (``TokenPrefill.pack``)
               3 * t + r + (r + 1) * max_pages)


class ModelRunner:
    """Runs the model over the paged cache. Owns the device array
    ``last_token[max_seqs + 1]``: sampling writes each row's token at its
    row slot; a decode row's input is gathered from it on the device (the
    token never round-trips through the host). Index ``max_seqs`` is the
    scratch row that padded rows read and write."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, cap: Capacity,
                 device: torch.device, kernels: KernelConfig, compile_decode: bool = False,
                 fused_decode: bool = True, token_prefill: int = 0):
        self.model, self.cache, self.cap, self.device = model, cache, cap, device
        self.kernels = kernels
        # The decode step: fused projections where the architecture has them
        # (fused_decode.py), else transformers' forward; why not, when not.
        self.decoder, self.not_fused = make_decoder(model, kernels, fused_decode)
        self.use_compiled(compile_decode)
        self.scratch_row = cap.max_seqs
        self.last_token = torch.zeros(cap.max_seqs + 1, dtype=torch.long, device=device)  # [S+1]
        self.max_pages = -(-cap.max_context // cap.page_size)
        # The fused step gathers its inputs in one kernel (step_inputs.py)
        # from rotary tables of every position a sequence can reach.
        self.rope = self.decoder.rope_table(cap.max_context) \
            if self.not_fused is None and self.decoder is not None else None
        # Short prefills as token rows through the fused step (token_prefill.py).
        self.token_prefill = None
        if token_prefill > 0 and self.not_fused is None:
            self.token_prefill = TokenPrefill(self.decoder, cache,
                                              min(token_prefill, cap.max_prefill_tokens),
                                              cap.max_rows, self.max_pages, device,
                                              kernels.dispatch)
        self.key_budget = prefill_key_budget(cap.max_prefill_tokens, cap.max_context)
        # [META_HEAD + 2 * max_rows + max_rows * max_pages]: the decode graphs' static input
        self.decode_meta = torch.zeros(META_HEAD + 2 * cap.max_rows + cap.max_rows * self.max_pages,
                                       dtype=torch.long, device=device)
        # Each row slot's page table on the host, scratch pages past its own
        # (``pack_decode``), and the pages tuple it was written from.
        self.host_pages = np.full((cap.max_seqs + 1, self.max_pages), cache.scratch_page, dtype=np.int64)
        self._pages_of: list[tuple[int, ...] | None] = [None] * (cap.max_seqs + 1)

    def use_compiled(self, on: bool) -> None:
        """torch.compile fuses the decode step's small elementwise kernels
        (norms, rotary, activations, residuals); the graphs then capture the
        compiled code. Batch and page dimensions are dynamic: one compile
        serves every bucket, and the token-row prefill graphs too."""
        self.compiled = on
        self.decode_step = self.decoder.compiled(on) if self.decoder else None

    @property
    def decode_path(self) -> str:
        """What runs a decode step, in words (reports and benchmarks)."""
        return self.decoder.path + (", compiled" if self.compiled else "")

    # -- decode ---------------------------------------------------------------

    def pages_needed(self, plan: StepPlan) -> int:
        return max(r.position // self.cap.page_size + 1 for r in plan.rows)

    def meta_views(self, meta, b: int, p: int):
        """Row slots ``[b]``, positions ``[b]`` and page table ``[b, p]`` of
        a decode metadata buffer (``decode_meta`` or a staging array)."""
        m, h = self.cap.max_rows, META_HEAD
        return meta[h:h + b], meta[h + m:h + m + b], meta[h + 2 * m:h + 2 * m + b * p].reshape(b, p)

    @staticmethod
    def meta_slot(meta):
        """The step's slot index ``[1]`` in a decode metadata buffer."""
        return meta[:1]

    def pack_decode(self, plan: StepPlan, staging: np.ndarray, b: int, p: int, slot: int = 0) -> int:
        """Write bucket (b, p)'s metadata for a step in slot ``slot`` into
        ``staging``; padded rows point at the scratch row and scratch page.
        Returns the element count to copy."""
        staging[:META_HEAD] = (slot, 0)
        row_slots, positions, table = self.meta_views(staging, b, p)
        rows, n = plan.rows, len(plan.rows)
        # Each part at once: a host-bound step at 64 rows spent about 45 us
        # here writing the rows one at a time. A row's page table is a row of
        # ``host_pages``, written when its pages change (a sequence keeps
        # them from admission to teardown), so a step copies rows of it.
        slots, pages_of = [r.row_slot for r in rows], self._pages_of
        for r in rows:
            if pages_of[r.row_slot] is not r.pages:
                self._remember_pages(r.row_slot, r.pages)
        row_slots[:n] = slots
        positions[:n] = [r.position for r in rows]
        table[:n] = self.host_pages[slots, :p]
        if n < b:  # padded rows
            row_slots[n:] = self.scratch_row
            positions[n:] = 0
            table[n:] = self.cache.scratch_page
        return META_HEAD + 2 * self.cap.max_rows + b * p

    def _remember_pages(self, row_slot: int, pages: tuple[int, ...]) -> None:
        row, kept = self.host_pages[row_slot], pages[:self.max_pages]  # no bucket reads further
        row[:] = self.cache.scratch_page
        row[:len(kept)] = kept
        self._pages_of[row_slot] = pages

    def decode_inputs(self, b: int, p: int) -> tuple[torch.Tensor, torch.Tensor, PagedContext]:
        """Input ids ``[B]``, positions ``[B]`` and the attention context of
        ``decode_meta`` read as bucket (b, p)."""
        row_slots, positions, page_table = self.meta_views(self.decode_meta, b, p)
        input_ids = self.last_token.index_select(0, row_slots)  # [B]
        ctx = decode_context(self.cache, positions, page_table, self.kernels.dispatch)
        return input_ids, positions, ctx

    def gathered_inputs(self, b: int, p: int, flags: torch.Tensor | None = None,
                        values: torch.Tensor | None = None):
        """``decode_meta`` read as bucket (b, p), through ``step_inputs``:
        input embeddings ``[B, D]`` (``values`` at a row slot whose ``flags``
        is set), positions ``[B]``, the attention context and the rows'
        rotary cos and sin."""
        row_slots, positions, page_table = self.meta_views(self.decode_meta, b, p)
        got = step_inputs(row_slots, positions, page_table, self.last_token,
                          self.decoder.embed.weight, self.rope, self.cache.page_size, flags, values,
                          pdl=self.decode_pdl(b))
        ctx = decode_context(self.cache, positions, page_table, self.kernels.dispatch,
                             got.slot_mapping)
        return got.x, positions, ctx, (got.cos, got.sin)

    def decode_pdl(self, b: int) -> bool:
        """Whether the decode step at ``b`` rows runs dependent launches
        (``pdl_step``'s layers and head): a kernel before its first may let
        it launch early, and one after its head may be launched dependent."""
        return self.rope is not None and self.decoder.uses_pdl(b, self.decoder.rope_in_kernel)

    def decode_forward(self, b: int, p: int) -> torch.Tensor:
        """The decode step; returns logits ``[b, V]``. Allocation-free to
        enqueue once captured as a graph."""
        if self.rope is not None:
            return self.decoder.decode_step(*self.gathered_inputs(b, p))[1]
        return self.decode_step(*self.decode_inputs(b, p))

    # -- prefill --------------------------------------------------------------

    def pack_prefill(self, plan: StepPlan, staging: np.ndarray, inputs: list | None = None,
                     prefix: np.ndarray | None = None, starts: np.ndarray | None = None
                     ) -> tuple[int, tuple[int, ...]]:
        """Pack ``[tokens T | positions T | slot T | out_gather T | q_start R |
        q_len R | pos0 R | last R | pages R*P]``, and with ``prefix`` (each
        row's bidirectional prefix length ``[R]``) ``prefix_end R`` after
        them; returns (count, (T, R, S, P), plus a 1 with a prefix).
        ``inputs`` are the rows' input ids (int64 arrays), by default their
        ``tokens``; ``starts`` their first positions, by default the rows'."""
        ps, rows = self.cap.page_size, plan.rows
        if inputs is None:
            inputs = [np.asarray(r.tokens, dtype=np.int64) for r in rows]
        lens = np.array([len(x) for x in inputs], dtype=np.int64)  # [R]
        pos0 = np.array([r.position for r in rows], dtype=np.int64) if starts is None \
            else starts  # [R]
        t, nr, s = int(lens.sum()), len(rows), int(lens.max())
        p = int(((pos0 + lens + ps - 1) // ps).max())
        q_start = np.concatenate(([0], np.cumsum(lens)[:-1]))  # [R]
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(pos0, lens)])  # [T]
        table = np.full((nr, p), self.cache.scratch_page, dtype=np.int64)  # [R, P]
        for i, r in enumerate(rows):
            pages = r.pages[:p]
            table[i, :len(pages)] = pages
        row_of = np.repeat(np.arange(nr), lens)  # [T]
        slot = table[row_of, positions // ps] * ps + positions % ps  # [T]
        out_gather = row_of * s + (np.arange(t) - q_start[row_of])  # [T]
        parts = [np.concatenate(inputs), positions, slot, out_gather, q_start, lens, pos0,
                 q_start + lens - 1, table.reshape(-1)]
        if prefix is not None:
            parts.append(pos0 + prefix)
        n = 0
        for part in parts:
            staging[n:n + part.size] = part
            n += part.size
        return n, (t, nr, s, p) + ((1,) if prefix is not None else ())

    def prefill_inputs(self, meta: torch.Tensor, shape: tuple[int, ...]):
        """From packed metadata on the device: input ids ``[1, T]``, position
        ids ``[1, T]``, each row's last token index ``[R]``, and the context."""
        t, nr, s, p = shape[:4]
        tokens, positions, slot, out_gather = (meta[i * t:(i + 1) * t] for i in range(4))
        q_start, q_len, pos0, last = (meta[4 * t + i * nr:4 * t + (i + 1) * nr] for i in range(4))
        end = 4 * t + 4 * nr + nr * p
        table = meta[4 * t + 4 * nr:end].view(nr, p)  # [R, P]
        prefix_end = meta[end:end + nr] if len(shape) > 4 else None  # [R]
        ctx = prefill_context(self.cache, slot, table, q_start, q_len, pos0, out_gather, s,
                              self.key_budget, prefix_end)
        return tokens.view(1, t), positions.view(1, t), last, ctx

    def prefill_forward(self, meta: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """``meta`` is the packed prefill metadata already on the device;
        returns the logits of each row's last token ``[R, V]``."""
        input_ids, positions, last, ctx = self.prefill_inputs(meta, shape)
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                         logits_to_keep=last, **{CONTEXT_KWARG: ctx})
        return out.logits[0]  # [R, V]
