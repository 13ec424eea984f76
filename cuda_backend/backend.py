"""CudaBackend: the Backend contract (core/protocol.py) on a transformers model.

Per step, in one of two DecodeSlots:

    launch    metadata host->device (pinned, non-blocking), forward (a graph
              replay for decode and short prefills, eager for long
              prefills), logits into the slot
    finalize  sampling inputs host->device, sampling (a graph replay): each
              row's token into the slot and into ``last_token[row_slot]``;
              event; device->host copy on the copy stream waiting on it
    wait      block on that copy's event only, read the landing buffer
    release   the slot may be launched into again (I4); legal only after
              wait or a reported failure, so nothing is still in flight

Forwards and samplings of both slots are enqueued on one compute stream, in
call order (I1), so a later step's forward reads the token an earlier step
sampled straight from device memory.

Sampling ahead (``KernelConfig.sample_ahead``): a decode step of few rows
samples greedily, unmasked, at the end of its forward's graph, into the
slot's ``sampled`` and ``last_token``. A finalize whose rows are all greedy
with no mask and no value keeps those tokens: no sampling inputs, no
sampling graph, no copy of the logits into the slot (launch defers it:
``_defer``). Any other finalize copies them and samples as before,
overwriting what was sampled ahead. One order would let a step see a
token sampled ahead that its finalize may replace: a launch whose rows
share a row slot with a step still launched. That launch first undoes
the other step's writes (the kernel kept what was there), and both steps
then sample at finalize, as without sampling ahead.

A steady-state decode step's launch and finalize make no host
synchronization and no device allocation (I10): every buffer is
preallocated, copies come from pinned memory, and the work is graph
replays. Without CUDA the same code runs eagerly on the CPU.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from bubblefree.core.protocol import Capacity, check_plan, check_sample, slot_index
from bubblefree.core.values import SamplePlan, StepFailed, StepKind, StepOutput, StepPlan
from bubblefree.cuda_backend import gumbel
from bubblefree.cuda_backend.errors import PlanRejected
from bubblefree.cuda_backend.cut_sample import make_cut_sampler
from bubblefree.cuda_backend.greedy_sample import make_sampler, torch_ahead, torch_greedy
from bubblefree.cuda_backend.graphs import GraphSet, batch_buckets, bucket, page_buckets
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.kv_cache import PagedKVCache
from bubblefree.cuda_backend.loader import LoadedModel, use_paged_attention
from bubblefree.cuda_backend.options import check_backend_options
from bubblefree.cuda_backend.runner import ModelRunner, staging_size
from bubblefree.cuda_backend.sampling import (PARTS, Draw, MaskTable, gumbel_noise, pack_sampling,
                                              sample_inputs, vocab_hash)
from bubblefree.cuda_backend.sizing import ModelDims, context_length, num_pages_for
from bubblefree.cuda_backend.slots import DecodeSlot, SlotState, make_slot

# Prefills of up to this many tokens (and a bounded summed context, see
# token_prefill.py) run as token rows in graphs.
DEFAULT_TOKEN_PREFILL = 2048


class CudaBackend:
    runner_class = ModelRunner  # what runs the forwards (a subclass may extend it)
    takes_images = False  # Capacity.images: runs IMAGE_PREFILL steps
    decodes_values = False  # Capacity.values: has a region head

    def __init__(self, model: LoadedModel | torch.nn.Module, *, page_size: int = 16,
                 num_pages: int | None = None, kv_memory_fraction: float = 0.9,
                 max_rows: int = 64, max_seqs: int = 256, max_prefill_tokens: int = 2048,
                 max_context: int | None = None, use_graphs: bool = True,
                 prefill_graphs: bool = True, compile_decode: bool | None = None, fused_decode: bool = True,
                 token_prefill: int | None = None, kernels: KernelConfig | None = None,
                 min_graph_context: int = 256, mask_capacity: int = 16):
        check_backend_options(dict(
            page_size=page_size, num_pages=num_pages, kv_memory_fraction=kv_memory_fraction,
            max_rows=max_rows, max_seqs=max_seqs, max_prefill_tokens=max_prefill_tokens,
            max_context=max_context, use_graphs=use_graphs, prefill_graphs=prefill_graphs,
            compile_decode=compile_decode,
            fused_decode=fused_decode, token_prefill=token_prefill,
            min_graph_context=min_graph_context, mask_capacity=mask_capacity))
        self.loaded = model if isinstance(model, LoadedModel) else None
        self.model = module = self.loaded.model if self.loaded else model
        use_paged_attention(module)
        param = next(module.parameters())
        self.device, self.dtype = param.device, param.dtype
        cuda = self.device.type == "cuda"
        dims = ModelDims.of(module)
        self._vocab = dims.vocab
        context = context_length(dims, max_context)
        if num_pages is None:
            num_pages = num_pages_for(dims, device=self.device, dtype=self.dtype,
                                      page_size=page_size, fraction=kv_memory_fraction,
                                      max_rows=max_rows, max_seqs=max_seqs,
                                      max_prefill_tokens=max_prefill_tokens,
                                      max_context=context)
        self._cap = Capacity(num_pages=num_pages, page_size=page_size, max_rows=max_rows,
                             max_seqs=max_seqs, max_prefill_tokens=max_prefill_tokens,
                             max_context=context, images=self.takes_images,
                             values=self.decodes_values, asynchronous=cuda)
        self.cache = PagedKVCache(layers=dims.layers, kv_heads=dims.kv_heads,
                                  head_dim=dims.head_dim, num_pages=num_pages,
                                  page_size=page_size, dtype=self.dtype, device=self.device)
        if compile_decode is None:  # on by default where graphs will capture it
            compile_decode = cuda and use_graphs
        if token_prefill is None:  # in graphs on CUDA; on the CPU its key gather costs more
            token_prefill = DEFAULT_TOKEN_PREFILL if cuda and use_graphs and prefill_graphs else 0
        # Off: every prefill eager, decode steps still in graphs (a baseline).
        self.prefill_graphs = use_graphs and prefill_graphs
        # Which kernels a step runs, chosen once: every graph captures this.
        measured = KernelConfig.measured(self.device, getattr(module, "config", None),
                                         dtype=self.dtype)
        self.kernels = measured if kernels is None else kernels
        self._runner = self.runner_class(module, self.cache, self._cap, self.device,
                                         self.kernels, compile_decode=compile_decode,
                                         fused_decode=fused_decode, token_prefill=token_prefill)
        self._masks = MaskTable(self._vocab, self.device, mask_capacity)
        self._salt = vocab_hash(self._vocab, self.device)  # [V]
        self._greedy = make_sampler(max_rows, self._vocab, self.device) \
            if self.kernels.greedy_kernel else None
        # Only beside the draw kernel's noise: a row draws with one noise whether its step cuts or not.
        self._cut = make_cut_sampler(self._vocab, self.device) \
            if self._greedy is not None and self.kernels.draw_kernel and self.kernels.cut_kernel \
            else None
        # Both slots' sampled tokens, and what sampling ahead overwrote
        # (tokens, then flags): a forward's graph finds its slot's row by index.
        self._sampled = torch.zeros(2, max_rows, dtype=torch.long, device=self.device)
        self._undo = torch.zeros(2, 2 * max_rows, dtype=torch.long, device=self.device)
        self._slots = [make_slot(i, staging_size=staging_size(self._cap), max_rows=max_rows,
                                 vocab_size=self._vocab, device=self.device,
                                 sampled=self._sampled[i]) for i in (0, 1)]
        self._compute = torch.cuda.Stream(self.device) if cuda else None  # I1: the one stream
        self._copy = torch.cuda.Stream(self.device) if cuda else None
        self._rows = batch_buckets(max_rows)
        ps = page_size
        self._pages = page_buckets(self._runner.max_pages, -(-min_graph_context // ps))
        self._decode_graphs = GraphSet(self.device, use_graphs)
        self._prefill_graphs = GraphSet(self.device, use_graphs, share_pool_of=self._decode_graphs)
        self._sample_graphs = GraphSet(self.device, use_graphs)
        if self._decode_graphs.enabled:
            self._capture_decode()
            if compile_decode and not self._decode_graphs.enabled:
                # The compiled step could not be captured: keep graphs, drop compile.
                warnings.warn("compiled decode step failed to capture; using it uncompiled",
                              RuntimeWarning, stacklevel=2)
                self._runner.use_compiled(False)
                self._decode_graphs = GraphSet(self.device, use_graphs)
                self._prefill_graphs = GraphSet(self.device, use_graphs,
                                                share_pool_of=self._decode_graphs)
                self._capture_decode()
            self._capture_prefill()
            self._capture_sampling()
        self._sync()  # set-up work on the default stream is done before the compute stream runs
        if self.loaded is not None:
            self.loaded.in_use = True

    # -- Backend protocol ---------------------------------------------------------

    @property
    def capacity(self) -> Capacity:
        return self._cap

    @property
    def decode_path(self) -> str:
        """What runs a decode step: "fused phi, compiled", "transformers", ..."""
        return self._runner.decode_path

    @property
    def prefill_path(self) -> str:
        """What runs a prefill step, in words."""
        tp = self._runner.token_prefill
        if tp is None:
            return "transformers"
        where = "in graphs" if self._prefill_graphs.enabled else "eager"
        return f"token rows {where} up to {tp.max_tokens} tokens, else transformers"

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def register_mask(self, allowed: frozenset[int]) -> int:
        """Off the hot path: waits for the device so no step in flight reads
        the table while it changes (or is reallocated)."""
        self._sync()
        mask_id, grew = self._masks.register(allowed)
        self._sync()
        if grew and self._sample_graphs.enabled:
            self._sample_graphs.clear()
            self._capture_sampling()
        return mask_id

    def launch(self, slot: int, plan: StepPlan) -> None:
        s = self._slot(slot)
        s.check("launch")
        check_plan(plan, self._cap, self._vocab, error=PlanRejected)
        self._check_launch(plan)
        try:
            with self._on(self._compute):
                shared = self._before_forward(s, plan)
                logits, b = self._forward(s, plan)
                self._defer(s, s.logits[:logits.shape[0]], logits)
                s.ahead = plan.kind is StepKind.DECODE and b <= self.kernels.sample_ahead \
                    and not shared
                if not s.ahead:
                    self._flush(s)
        except Exception as ex:  # noqa: BLE001 - any forward failure fails the step's rows
            self._quiesce()
            s.ahead = False
            s.pending.clear()
            self._forward_failed(s)
            raise StepFailed(f"step {plan.step_id}: forward failed: {ex!r}") from ex
        s.advance("launch")
        s.plan, s.bucket = plan, b

    def finalize(self, slot: int, sample: SamplePlan) -> None:
        s = self._slot(slot)
        s.check("finalize")
        plan, b = s.plan, s.bucket
        self._check_sample(sample, plan)
        kept = s.ahead and not sample.values and all(m is None for m in sample.mask_ids) \
            and not any(r.sampling.temperature for r in plan.rows)
        draw = Draw.GREEDY if kept else pack_sampling(s.sample_np, plan.rows, sample.mask_ids, b,
                                                      self._runner.scratch_row)
        n = len(plan.rows)
        try:
            with self._on(self._compute):
                if kept:  # the tokens sampled ahead stand: nothing reads the forward's outputs
                    s.pending.clear()
                else:
                    self._flush(s)
                    s.sample_inputs[:PARTS * b].copy_(s.sample_staging[:PARTS * b], non_blocking=True)
                    self._sample_graphs.run((slot, b, draw), lambda: self._sample(s, b, draw))
                s.ahead = False
                self._after_sampling(s, sample, b, draw is Draw.GREEDY)
                if self._copy is not None:
                    s.sampled_event.record(self._compute)
                    self._copy.wait_event(s.sampled_event)  # this step's outputs, nothing later
                    with torch.cuda.stream(self._copy):
                        self._copy_out(s, n)
                        s.copied_event.record(self._copy)
                else:
                    self._copy_out(s, n)
        except Exception as ex:  # noqa: BLE001
            self._quiesce()
            s.state = SlotState.FAILED
            raise StepFailed(f"step {plan.step_id}: sampling failed: {ex!r}") from ex
        s.advance("finalize")

    def wait(self, slot: int) -> StepOutput:
        s = self._slot(slot)
        s.check("wait")
        try:
            if s.copied_event is not None:
                s.copied_event.synchronize()  # this copy only, not the device
        except Exception as ex:  # noqa: BLE001 - an asynchronous device error surfaces here
            s.state = SlotState.FAILED
            raise StepFailed(f"step {s.plan.step_id}: device error: {ex!r}") from ex
        s.advance("wait")
        return self._output(s)

    def release(self, slot: int) -> None:
        s = self._slot(slot)
        s.check("release")
        failed = s.state is SlotState.FAILED
        if failed:  # the failed work may still hold the slot's buffers
            self._quiesce()
        s.advance("release")
        s.plan, s.ahead = None, False
        s.pending.clear()
        self._released(s, failed)

    # -- what a step runs (a subclass with more step kinds or outputs overrides) --

    def _check_launch(self, plan: StepPlan) -> None:
        """Checks beyond the contract's, before anything is enqueued."""

    def _forward(self, s: DecodeSlot, plan: StepPlan) -> tuple[torch.Tensor, int]:
        """Enqueue ``plan``'s forward; returns its logits ``[>= rows, V]`` and
        the row bucket it samples at."""
        n = len(plan.rows)
        if plan.kind is StepKind.DECODE:
            b = bucket(n, self._rows)
            p = bucket(self._runner.pages_needed(plan), self._pages)
            k = self._runner.pack_decode(plan, s.staging_np, b, p, slot=s.index)
            self._runner.decode_meta[:k].copy_(s.staging[:k], non_blocking=True)
            return self._decode_graphs.run((b, p), lambda: self._decode_step(b, p)), b  # [b, V]
        if (tp := self._runner.token_prefill) is not None and tp.fits(plan):
            return tp.launch(plan, s.staging_np, s.staging, self._prefill_graphs)
        k, shape = self._runner.pack_prefill(plan, s.staging_np)
        meta = s.staging[:k].to(self.device, non_blocking=True)
        return self._runner.prefill_forward(meta, shape), bucket(n, self._rows)  # [n, V]

    def _decode_step(self, b: int, p: int) -> torch.Tensor:
        """What the decode graphs record for bucket (b, p): the forward, and
        at up to ``sample_ahead`` rows its greedy tokens into the slot the
        metadata names. Returns the logits ``[b, V]``."""
        r = self._runner
        logits = r.decode_forward(b, p)
        if b <= self.kernels.sample_ahead:
            args = (logits, r.meta_views(r.decode_meta, b, p)[0], r.meta_slot(r.decode_meta),
                    self._sampled, self._undo, r.last_token, self._sample_clears())
            if self._greedy is not None:
                self._greedy.ahead(*args, pdl=r.decode_pdl(b))
            else:
                torch_ahead(*args)
        return logits

    def _defer(self, s: DecodeSlot, into: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the forward's output ``src`` into the slot's ``into`` when
        something reads it: at a finalize that samples, or before the next
        launch (whose forward may overwrite ``src``, a graph's output). Both
        come after the forward in stream order (I1)."""
        s.pending.append((into, src))

    def _flush(self, s: DecodeSlot) -> None:
        for into, src in s.pending:
            into.copy_(src)
        s.pending.clear()

    def _before_forward(self, s: DecodeSlot, plan: StepPlan) -> bool:
        """On the compute stream, before ``plan``'s forward in slot ``s``:
        the other slot's deferred copies; and where that slot's step is
        launched, sampled ahead and shares a row slot with ``plan``, what
        its sampling ahead wrote there undone, so this forward reads the
        tokens sampled before it (the contract's). Returns whether rows
        were shared: then both steps sample at finalize."""
        shared = False
        for o in self._slots:
            if o is s:
                continue
            self._flush(o)
            if not (o.ahead and o.state is SlotState.LAUNCHED):
                continue
            mine = {r.row_slot for r in plan.rows}
            if not any(r.row_slot in mine for r in o.plan.rows):
                continue
            n, m = len(o.plan.rows), self._cap.max_rows
            # A pageable copy that waits for the device: this order is legal
            # but never the engine's, so its launch may pay one.
            rows = torch.tensor([r.row_slot for r in o.plan.rows], device=self.device)
            self._runner.last_token.index_copy_(0, rows, self._undo[o.index, :n])
            if (flags := self._sample_clears()) is not None:
                flags.index_copy_(0, rows, self._undo[o.index, m:m + n].bool())
            o.ahead, shared = False, True
        return shared

    def _forward_failed(self, s: DecodeSlot) -> None:
        """A launch raised: undo what ``_forward`` recorded on the host."""

    def _check_sample(self, sample: SamplePlan, plan: StepPlan) -> None:
        # A misuse, not StepFailed: the slot stays LAUNCHED and may be finalized
        # again with a right plan (row 0 of the table is no registered mask).
        check_sample(sample, plan, range(1, self._masks.count), values=self._cap.values)

    def _after_sampling(self, s: DecodeSlot, sample: SamplePlan, b: int, greedy: bool) -> None:
        """More device work of the finalize phase, on the compute stream after
        sampling and before the event the host copy waits on."""

    def _copy_out(self, s: DecodeSlot, n: int) -> None:
        """The device-to-host copies of a step's outputs (on the copy stream
        when there is one)."""
        s.landing[:n].copy_(s.sampled[:n], non_blocking=self._copy is not None)

    def _released(self, s: DecodeSlot, failed: bool) -> None:
        """The slot was released (after a reported failure with ``failed``):
        drop what its step kept alive."""

    def _output(self, s: DecodeSlot) -> StepOutput:
        """The step's output, read from the landing buffers once copied."""
        tokens = tuple(s.landing[:len(s.plan.rows)].tolist())
        return StepOutput(step_id=s.plan.step_id, tokens=tokens)

    # -- internals ------------------------------------------------------------------

    def _slot(self, slot: int) -> DecodeSlot:
        return self._slots[slot_index(slot)]

    def _on(self, stream):
        """no_grad, on ``stream`` when there is one."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        if stream is not None:
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _quiesce(self) -> None:
        """Failure path: let queued work drain so no buffer is reused under it."""
        with contextlib.suppress(Exception):
            self._sync()

    def _sample(self, s: DecodeSlot, b: int, draw: Draw) -> torch.Tensor:
        """Sampling of slot ``s`` at bucket ``b`` (what the sampling graphs
        record, one a ``Draw``): each row's token into ``s.sampled`` and
        ``last_token`` at its row slot (padded rows: the scratch row), and
        ``_sample_clears`` cleared there."""
        last, clears = self._runner.last_token, self._sample_clears()
        args = (s.logits, self._masks.table, s.sample_inputs, b, s.sampled, last, clears)
        if draw is Draw.GREEDY:
            (self._greedy or torch_greedy)(*args)
            return s.sampled
        kernel_draws = self._greedy is not None and self.kernels.draw_kernel
        if draw is Draw.PLAIN and kernel_draws:  # the greedy kernel, each drawn row's noise added
            self._greedy(*args, drawn=True)
            return s.sampled
        if draw is Draw.CUT and self._cut is not None:  # two kernels around the sort
            self._cut(*args)
            return s.sampled
        row_slots, tokens = sample_inputs(s.sample_inputs, s.logits, self._masks.table, self._salt,
                                          b, draw, gumbel.noise if kernel_draws else gumbel_noise)
        s.sampled[:b].copy_(tokens)
        last.index_copy_(0, row_slots, tokens)
        if clears is not None:
            clears.index_fill_(0, row_slots, False)
        return s.sampled

    def _sample_clears(self) -> torch.Tensor | None:
        """A per-row-slot bool array every sampling clears at its rows' slots
        (a subclass's flag that only some finalize-phase work sets), or None."""
        return None

    def _capture_decode(self) -> None:
        r, meta = self._runner, self._runner.decode_meta

        def items():
            for b in reversed(self._rows):
                for p in reversed(self._pages):
                    def prepare(b=b, p=p):  # padded rows only: scratch row, position 0 and page
                        row_slots, positions, table = r.meta_views(meta, b, p)
                        row_slots.fill_(r.scratch_row)
                        positions.zero_()
                        table.fill_(self.cache.scratch_page)
                        r.meta_slot(meta).zero_()
                    yield (b, p), prepare, (lambda b=b, p=p: self._decode_step(b, p))
        with self._on(self._compute):
            self._decode_graphs.capture_all(items())
        self._sync()

    def _capture_prefill(self) -> None:
        if self._runner.token_prefill is not None:
            with self._on(self._compute):
                self._runner.token_prefill.capture(self._prefill_graphs)
            self._sync()

    def _capture_sampling(self) -> None:
        self._capture_per_slot(self._sample_graphs, self._sample, tuple(Draw))

    def _capture_per_slot(self, graphs: GraphSet, fn, kinds=(True, False), reset=None) -> None:
        """A graph of ``fn(slot, b, kind)`` per slot, row bucket and kind of
        sampling (``kinds``: the greedy flag, or each ``Draw``; finalize-phase
        work: it reads the slot's sampling inputs, which hold padded rows
        only while capturing; ``reset(slot)`` clears more)."""
        def items():
            for s in self._slots:
                for b in reversed(self._rows):
                    for kind in kinds:
                        def prepare(s=s, b=b):
                            s.sample_inputs.zero_()
                            s.sample_inputs[:b].fill_(self._runner.scratch_row)
                            if reset is not None:
                                reset(s)
                        yield (s.index, b, kind), prepare, (lambda s=s, b=b, k=kind: fn(s, b, k))
        with self._on(self._compute):
            graphs.capture_all(items())
        self._sync()
