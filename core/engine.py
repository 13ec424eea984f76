"""The Engine: drives the Scheduler and a Backend through the tick.

Pipelined (the default), each ``tick()`` is the seed's three phases::

    launch    plan the next step into a free DecodeSlot, enqueue its forward
    commit    wait for the oldest finalized step's host copy, apply it (I2)
    finalize  masks for the newest launched step from the states *after*
              that commit (I9); enqueue sampling and the host copy

Blocking mode is the same machine in series — launch, finalize, commit — and
is one flag away (``pipelined=False``): the baseline for every comparison.

A backend fault (``StepFailed``) fails the rows of the step it hit; their
resources come back and the engine keeps serving (I7).
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator

import attrs

from bubblefree.core.backend import Backend
from bubblefree.core.pages import pages_needed
from bubblefree.core.scheduler import Scheduler
from bubblefree.core.sequence import Sequence
from bubblefree.core.values import InvalidRequest, Request, Result, Status, StepFailed


@attrs.define(eq=False)
class Handle:
    """A submitted request: streams tokens, then holds exactly one Result."""

    request_id: int
    request: Request
    _engine: "Engine"
    tokens: list[int] = attrs.Factory(list)
    result: Result | None = None
    listeners: list[Callable[["Handle", int | None], None]] = attrs.Factory(list)

    @property
    def done(self) -> bool:
        return self.result is not None

    def cancel(self) -> bool:
        return self._engine.cancel(self.request_id)

    def wait(self) -> Result:
        """Drive the engine in this thread until this request has ended. Only
        for an engine no other thread drives (``bubblefree``'s serving loop
        owns its engine: wait on a listener there instead)."""
        while self.result is None:
            if not self._engine.tick():
                raise RuntimeError(f"request {self.request_id}: engine idle before it ended")
        return self.result

    def __iter__(self) -> Iterator[int]:
        """Yield tokens as they are committed, driving the engine."""
        seen = 0
        while True:
            while seen < len(self.tokens):
                seen += 1
                yield self.tokens[seen - 1]
            if self.result is not None:
                return
            if not self._engine.tick():
                raise RuntimeError(f"request {self.request_id}: engine idle before it ended")


@attrs.define(eq=False)
class Engine:
    backend: Backend
    pipelined: bool = True
    probe: Callable[[str], None] = lambda situation: None
    scheduler: Scheduler = attrs.field(init=False)
    handles: dict[int, Handle] = attrs.Factory(dict)
    trace: list[tuple] = attrs.Factory(list)  # event log, for replay hashing
    # A long-lived server must not keep every step forever: past twice this
    # many entries the oldest half is dropped (None keeps everything).
    trace_limit: int | None = None
    _masks: list[frozenset[int]] = attrs.Factory(list)
    _mask_ids: dict[int, int] = attrs.Factory(dict)  # backend id -> index in _masks
    _ids: Iterator[int] = attrs.Factory(itertools.count)

    def __attrs_post_init__(self) -> None:
        self.scheduler = Scheduler(self.backend.capacity, probe=self.probe, on_finish=self._finished)

    # ------------------------------------------------------------------ public
    def register_mask(self, allowed: Iterable[int]) -> int:
        """Store an allowed-token set with the backend, off the hot path."""
        allowed = frozenset(allowed)
        bad = [t for t in allowed if not 0 <= t < self.backend.vocab_size]
        if not allowed or bad:
            raise ValueError(f"mask must be a non-empty set of token ids < {self.backend.vocab_size}")
        mask_id = self.backend.register_mask(allowed)
        self._mask_ids[mask_id] = len(self._masks)
        self._masks.append(allowed)
        return mask_id

    def allowed(self, mask_id: int) -> frozenset[int]:
        return self._masks[self._mask_ids[mask_id]]

    def submit(self, request: Request) -> Handle:
        """Accept a request or raise ``InvalidRequest`` naming what is wrong."""
        self._validate(request)
        seq_id = next(self._ids)
        handle = Handle(seq_id, request, self)
        self.handles[seq_id] = handle
        self.scheduler.add(Sequence(seq_id, request))
        self._log(("submit", seq_id))
        return handle

    def cancel(self, request_id: int) -> bool:
        ok = self.scheduler.cancel(request_id)
        if ok:
            self._log(("cancel", request_id))
        return ok

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def tick(self) -> bool:
        """One launch / commit / finalize (or its blocking order). Returns
        False when there was nothing to do."""
        if self.pipelined:
            progress = self._launch()
            progress = self._commit() or progress
            progress = self._finalize() or progress
        else:
            progress = self._launch()
            progress = self._finalize() or progress
            progress = self._commit() or progress
        return progress

    def run_until_idle(self, max_ticks: int | None = None) -> None:
        ticks = 0
        while self.tick():
            ticks += 1
            if max_ticks is not None and ticks >= max_ticks and self.has_work():
                raise RuntimeError(f"engine still busy after {max_ticks} ticks")

    def abort(self, reason: str) -> None:
        """Fail every live request with ``reason``; for a lost device."""
        self.scheduler.abort(reason)
        self._log(("abort", reason))

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ------------------------------------------------------------------ phases
    def _launch(self) -> bool:
        planned = self.scheduler.plan_launch()
        if planned is None:
            return False
        slot, plan = planned
        try:
            self.backend.launch(slot.index, plan)
        except StepFailed as fault:
            self._log(("launch_failed", plan.step_id, fault.reason))
            self.scheduler.launch_failed(plan, fault.reason)
            return True
        self.scheduler.launched(slot, plan)
        self._log(("launch", plan.step_id, plan.kind.value, slot.index,
                           tuple(r.seq_id for r in plan.rows)))
        return True

    def _finalize(self) -> bool:
        planned = self.scheduler.plan_finalize()
        if planned is None:
            return False
        step, sample = planned
        failed = None
        try:
            self.backend.finalize(step.slot, sample)
        except StepFailed as fault:
            failed = fault.reason
        self.scheduler.finalized(step, failed)
        self._log(("finalize", step.step_id, sample.mask_ids, failed))
        return True

    def _commit(self) -> bool:
        step = self.scheduler.next_commit()
        if step is None:
            return False
        output, failed = None, step.failed
        if failed is None:
            try:
                output = self.backend.wait(step.slot)
            except StepFailed as fault:
                failed = fault.reason
        self.scheduler.commit(step, output, failed, self.allowed, self._emit)
        self.backend.release(step.slot)
        self._log(("commit", step.step_id, output.tokens if output else None, failed))
        return True

    def _log(self, entry: tuple) -> None:
        self.trace.append(entry)
        if self.trace_limit is not None and len(self.trace) > 2 * self.trace_limit:
            del self.trace[:len(self.trace) - self.trace_limit]

    # --------------------------------------------------------------- callbacks
    def _emit(self, seq: Sequence, token: int) -> None:
        handle = self.handles[seq.seq_id]
        handle.tokens.append(token)
        for listener in handle.listeners:
            listener(handle, token)

    def _finished(self, seq: Sequence) -> None:
        handle = self.handles.pop(seq.seq_id)
        if handle.result is not None:
            raise AssertionError(f"I7: request {seq.seq_id} answered twice")
        req = seq.request
        status, reason, output = seq.status, seq.finish_reason, None
        if req.finisher is not None:
            try:
                output = req.finisher(tuple(seq.tokens), seq.state)
            except Exception as err:  # noqa: BLE001 - a skill's bug fails its request only
                status, reason = Status.FAILED, f"finisher raised {type(err).__name__}: {err}"
        handle.result = Result(request_id=seq.seq_id, status=status, tokens=tuple(seq.tokens),
                               finish_reason=reason, output=output, tag=req.tag)
        self._log(("end", seq.seq_id, status.value, reason))
        for listener in handle.listeners:
            listener(handle, None)

    # -------------------------------------------------------------- validation
    def _validate(self, req: Request) -> None:
        cap, vocab = self.backend.capacity, self.backend.vocab_size
        n = len(req.prompt)
        if n == 0:
            raise InvalidRequest("prompt: must hold at least one token")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in req.prompt):
            raise InvalidRequest(f"prompt: token ids must be ints in [0, {vocab})")
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise InvalidRequest(f"max_tokens: must be an int >= 1, got {req.max_tokens!r}")
        if any(not 0 <= t < vocab for t in req.stop_ids):
            raise InvalidRequest(f"stop_ids: token ids must be in [0, {vocab})")
        if n > cap.max_prefill_tokens:
            raise InvalidRequest(f"prompt: {n} tokens, more than the {cap.max_prefill_tokens} one prefill takes")
        if n + req.max_tokens > cap.max_context:
            raise InvalidRequest(
                f"max_tokens: prompt ({n}) + max_tokens ({req.max_tokens}) exceeds the context ({cap.max_context})")
        need = pages_needed(n, req.max_tokens, cap.page_size)
        if need > cap.num_pages:
            raise InvalidRequest(f"max_tokens: needs {need} KV pages, the cache has {cap.num_pages}")
        if req.adapter is not None and cap.num_adapter_slots == 0:
            raise InvalidRequest("adapter: this backend has no adapter slots")
