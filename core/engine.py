"""The Engine: drives the Scheduler and a Backend through the tick.

Pipelined (the default), each ``tick()`` is the seed's three phases::

    launch    plan the next step into a free DecodeSlot, enqueue its forward
    commit    wait for the oldest finalized step's host copy, apply it (I2)
    finalize  masks for the newest launched step from the states *after*
              that commit (I9); enqueue sampling and the host copy

Blocking mode is the same machine in series — launch, finalize, commit — and
is one flag away (``pipelined=False``): the baseline for every comparison.
``pipelined="auto"`` runs the pipelined tick and chooses at its end whether
to commit the step it finalized now (as blocking does) or leave it for the
next launch to go ahead of (``ahead.py``: the rule, and why both are safe);
the clock it measures the bubble with is injected (``clock``), so tests fix
it.

A backend fault (``StepFailed``) fails the rows of the step it hit; their
resources come back and the engine keeps serving (I7).

Delivery. The scheduler reports committed tokens and ends as events; after
each phase the Engine applies them to the handles (tokens, then the one
Result), and at the end of the tick, of ``cancel`` or of ``abort`` it runs
the listeners, outside the state machine. A listener may cancel or submit;
one that raises fails its own request (if it has not ended yet) and nothing
else; a raise on a request that already ended is kept in
``listener_errors``.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import random
import secrets
import time
from typing import Callable, Iterable, Iterator, Literal

import attrs

from bubblefree.core.protocol import Backend
from bubblefree.core.ahead import Behind, May, check_mode, choose
from bubblefree.core.ahead_measures import EndRates, Successors, Timings, Worth, bought
from bubblefree.core.decode_state import guarded
from bubblefree.core.events import TokenCommitted
from bubblefree.core.handle import Handle
from bubblefree.core.integrity import InvariantViolation
from bubblefree.core.pages import pages_needed
from bubblefree.core.scheduler import Scheduler
from bubblefree.core.sequence import Sequence
from bubblefree.core.values import (ImageRef, InvalidRequest, Request, Result, SamplingParams, Status, StepFailed,
                                   bad_prompt_values, described, integer)


def closed(returned: object) -> None:
    """Close what a listener returned if it can be closed (a coroutine: no
    "never awaited" warning); nothing here awaits it. The caller's object:
    its ``close`` raising changes nothing."""
    close = getattr(returned, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - the caller's object, already failed or ended
            pass


@attrs.define(eq=False)
class Engine:
    backend: Backend
    # True: always launch ahead; False: blocking; "auto": chosen per tick.
    pipelined: bool | Literal["auto"] = attrs.field(default=True, validator=lambda _s, _a, v: check_mode(v))
    probe: Callable[[str], None] = lambda situation: None
    # Host clock for the auto mode's measurements (``ahead_measures.Timings``).
    clock: Callable[[], float] = time.perf_counter
    # Requests handed over and not yet submitted: what the serving loop's
    # inbox holds. The auto rule foresees their prefill (``ahead._taken``).
    arrivals: Callable[[], int] = lambda: 0
    # Who drives this engine's ticks (a weak reference to it), set once by
    # that driver: two serving loops on one core each number their requests
    # from 0 and tick it from two threads.
    driver: Callable[[], object] | None = attrs.field(default=None, init=False)
    scheduler: Scheduler = attrs.field(init=False)
    timings: Timings = attrs.field(init=False)
    end_rates: EndRates = attrs.Factory(EndRates)
    successors: Successors = attrs.Factory(Successors)
    handles: dict[int, Handle] = attrs.Factory(dict)
    trace: list[tuple] = attrs.Factory(list)  # event log, for replay hashing
    # A long-lived server must not keep every step forever: past twice this
    # many entries the oldest half is dropped (None keeps everything).
    trace_limit: int | None = None
    # Registered masks by backend id: the one registry, shared with the
    # scheduler, which checks a skill's mask ids and the sampled tokens (I9).
    masks: dict[int, frozenset[int]] = attrs.Factory(dict)
    # Listener raises that could fail no request (it had already ended); the
    # newest ``LISTENER_ERRORS_KEPT``.
    listener_errors: collections.deque[str] = attrs.Factory(
        lambda: collections.deque(maxlen=LISTENER_ERRORS_KEPT))
    _ids: Iterator[int] = attrs.Factory(itertools.count)
    _outbox: collections.deque = attrs.Factory(collections.deque)  # (handle, token | None)
    _delivering: bool = False
    # Rows that may end at the pending commit, by (skill, position), for
    # ``EndRates``; and the sequences that ended since that choice (kept only
    # while there are such rows), so learning does not look up every row.
    _may_end: May = attrs.field(factory=dict, init=False)
    _ended: set[int] = attrs.field(factory=set, init=False)
    # Auto's choices so far, for a user to see how often it blocks: ticks
    # that weighed the rule and left their step in flight, ticks that
    # committed it at once, and ticks that left it in flight unweighed
    # (``ahead_measures.Worth``: choosing was not worth its host time); and why it
    # blocked, the rule's inputs at the newest ``BEHIND_KEPT`` behind ticks.
    ahead_ticks: int = 0
    behind_ticks: int = 0
    unweighed_ticks: int = 0
    # Host-clock seconds auto has spent choosing (``_ahead``): the rule's own
    # cost, which pipelined does not pay. Where the host sets a step's pace
    # (64 constrained rows on a small model) it is what auto gives up.
    choose_host: float = 0.0
    # Whether a tick's choice is worth its host time (``ahead_measures.Worth``).
    worth: Worth = attrs.Factory(Worth)
    behind: collections.deque[Behind] = attrs.field(
        factory=lambda: collections.deque(maxlen=BEHIND_KEPT), init=False)
    # Seeds for requests that bring none (``SamplingParams.seeded``): fresh
    # in each process; a test that must repeat them gives its own.
    seeds: random.Random = attrs.Factory(lambda: random.Random(secrets.randbits(64)))

    def __attrs_post_init__(self) -> None:
        self.scheduler = Scheduler(self.backend.capacity, probe=self.probe, masks=self.masks)
        self.timings = Timings(self.clock)

    # ------------------------------------------------------------------ public
    def register_mask(self, allowed: Iterable[int]) -> int:
        """Store an allowed-token set with the backend, off the hot path."""
        allowed = frozenset(map(integer, allowed))  # numpy's integers are ids too
        vocab = self.backend.vocab_size
        outside = sorted((t for t in allowed if type(t) is not int or not 0 <= t < vocab), key=repr)
        if not allowed or outside:
            named = f"; outside it: {', '.join(map(repr, outside[:5]))}" if outside else ""
            raise ValueError(f"mask must be a non-empty set of int token ids < {vocab}{named}")
        mask_id = self.backend.register_mask(allowed)
        self.masks[mask_id] = allowed
        return mask_id

    def fresh_seed(self) -> int:
        """A seed for a request that brings none (``seeds``)."""
        return self.seeds.getrandbits(64)

    def allowed(self, mask_id: int) -> frozenset[int]:
        return self.masks[mask_id]

    def submit(self, request: Request, request_id: int | None = None) -> Handle:
        """Accept a request or raise ``InvalidRequest`` naming what is wrong.
        ``request_id`` lets a caller that hands ids out itself choose one."""
        self.validate(request)
        if request.sampling.seed is None:  # the request's own seed, drawn once (I8 holds for it)
            request = attrs.evolve(request, sampling=request.sampling.seeded(self.fresh_seed))
        seq_id = next(self._ids) if request_id is None else request_id
        if seq_id in self.handles or seq_id in self.scheduler.seqs:
            raise ValueError(f"request id {seq_id} is in use")
        handle = Handle(seq_id, request, self)
        self.handles[seq_id] = handle
        self.scheduler.add(Sequence(seq_id, request))
        self.successors.submitted += 1
        self._log(("submit", seq_id))
        return handle

    def cancel(self, request_id: int, reason: str | None = None) -> bool:
        """End a live request: cancelled, or failed with ``reason`` when given.
        False when it had already ended (or never existed)."""
        status = Status.CANCELLED if reason is None else Status.FAILED
        ok = self.scheduler.cancel(request_id, status, reason or "cancelled")
        if ok:
            self._log(("cancel", request_id))
            self._absorb()
            self._deliver()
        return ok

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def delivering(self) -> bool:
        """True while listeners run: the state machine is consistent, so a
        listener may cancel or submit. Code that runs mid-phase (a skill, a
        garbage-collection finalizer) sees False and must not call in."""
        return self._delivering

    def tick(self) -> bool:
        """One launch / commit / finalize (or its blocking order). Returns
        False when there was nothing to do."""
        # Blocking starts with a commit, a no-op but right after a switch from
        # pipelined: the step that mode left in flight must commit before a
        # new step's masks are built, or they miss its token (I9).
        if self.pipelined is False:
            phases = (self._commit, self._launch, self._finalize, self._commit)
        else:
            phases = (self._launch, self._commit, self._finalize)
        progress = False
        for phase in phases:
            progress = phase() or progress
            self._absorb()
        self._learn()
        if self.pipelined == "auto" and self.scheduler.inflight:
            if self.backend.capacity.asynchronous and not self.worth.weigh():
                # Choices have bought little for their host time: the step
                # stays in flight unweighed, as pipelined leaves it.
                self.unweighed_ticks += 1
            elif self._ahead():  # the step stays in flight, and the next tick launches first
                self.ahead_ticks += 1
            else:
                # Behind: the step just finalized commits now, in this tick,
                # as blocking's does, so its ends reach the caller (the
                # listeners below, and whatever the caller does before the
                # next tick: a closed loop's next request) before the next
                # step is planned.
                self.behind_ticks += 1
                progress = self._commit() or progress
                self._absorb()
                self._learn()
        self._deliver()
        return progress

    def _ahead(self) -> bool:
        """Auto mode, at the end of a tick: leave the step just finalized in
        flight, so that the next tick launches before committing it? Never
        on a backend whose launch computes its step before it returns
        (``Capacity.asynchronous``): there the bubble the rule measures is
        the forward itself, which launching ahead cannot hide. (``tick``
        asks it only where ``ahead_measures.Worth`` says the choice is worth its host
        time.)"""
        if not self.backend.capacity.asynchronous:
            self._may_end = {}
            return False
        started = self.clock()
        t = self.timings
        follow, forward = self.successors.rate, t.forward or 0.0
        choice = choose(self.scheduler, self.end_rates, follow, t.bubble, forward, t.prefill_extra,
                        self.arrivals())
        self._may_end = choice.may
        self._ended = set()  # its rows were all live: none has ended since
        if not choice.ahead:
            self.behind.append(Behind(choice.rows, choice.zombies, choice.bubble, forward, follow))
        spent = self.clock() - started
        self.choose_host += spent
        self.worth.record(spent, bought(choice, forward))
        return choice.ahead

    def _learn(self) -> None:
        """Count, per skill and position, whether the rows that could end at
        the commit the last choice was about did (a cancel in between counts
        as an end): every end since reached ``_absorb`` as ``SequenceEnded``."""
        if not self._may_end:
            return
        ended = self._ended
        for (skill, at), sids in self._may_end.items():  # at 64 rows, one or two keys a tick
            self.end_rates.add(skill, at, len(ended.intersection(sids)), len(sids))
        self._may_end, self._ended = {}, set()

    def run_until_idle(self, max_ticks: int | None = None) -> None:
        ticks = 0
        while self.tick():
            ticks += 1
            if max_ticks is not None and ticks >= max_ticks and self.has_work():
                raise RuntimeError(f"engine still busy after {max_ticks} ticks")

    def abort(self, reason: str) -> None:
        """Fail every live request with ``reason``; for a lost device."""
        self.scheduler.abort(reason)
        self.timings.forget()
        self._log(("abort", reason))
        self._absorb()
        self._deliver()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # ------------------------------------------------------------------ phases
    def _launch(self) -> bool:
        started = self.timings.clock()
        planned = self.scheduler.plan_launch()
        if planned is None:
            return False
        slot, plan = planned
        self.successors.launching()
        try:
            self.backend.launch(slot.index, plan)
        except StepFailed as fault:
            self._log(("launch_failed", plan.step_id, fault.reason))
            self.scheduler.launch_failed(plan, fault.reason)
            return True
        self.timings.launched(plan.step_id, started, plan.kind)
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
        if failed is None:
            arrived = self.timings.arrived(step.step_id)
        else:
            self.timings.forget(step.step_id)
        self.scheduler.commit(step, output, failed)
        self.backend.release(step.slot)
        if failed is None:
            self.timings.committed(arrived)
        self._log(("commit", step.step_id, output.tokens if output else None, failed))
        return True

    def _log(self, entry: tuple) -> None:
        self.trace.append(entry)
        if self.trace_limit is not None and len(self.trace) > 2 * self.trace_limit:
            del self.trace[:len(self.trace) - self.trace_limit]

    # ---------------------------------------------------------------- delivery
    def _absorb(self) -> None:
        """Apply the scheduler's events to the handles: the state a caller
        reads is current after every phase; listeners run later."""
        for event in self.scheduler.take_events():
            if isinstance(event, TokenCommitted):
                handle = self.handles[event.seq_id]
                handle.tokens.append(event.token)
                self._outbox.append((handle, event.token))
                continue
            handle = self.handles.pop(event.seq_id, None)
            if handle is None or handle.result is not None:
                raise InvariantViolation(f"I7: request {event.seq_id} answered twice")
            self.successors.ends += 1
            if self._may_end:
                self._ended.add(event.seq_id)
            handle.result = self._result(event.seq)
            self._log(("end", event.seq_id, handle.result.status.value, handle.result.finish_reason))
            self._outbox.append((handle, None))

    def _result(self, seq: Sequence) -> Result:
        req, output = seq.request, None
        status, reason = seq.status, seq.finish_reason
        if req.finisher is not None and not seq.state_held:  # another's state: not its output
            output, error = guarded(req, "finish", req.finisher, tuple(seq.tokens), seq.state)
            if error is not None and status is not Status.FAILED:  # a failure keeps its first cause
                status, reason = Status.FAILED, error
        return Result(request_id=seq.seq_id, status=status, tokens=tuple(seq.tokens),
                      finish_reason=reason, output=output, tag=req.tag)

    def _deliver(self) -> None:
        """Run listeners for what was absorbed, in order. Reentrant calls (a
        listener that cancels) only queue: the outermost loop delivers."""
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._outbox:
                handle, token = self._outbox.popleft()
                for listener in tuple(handle.listeners):
                    try:
                        returned = listener(handle, token)
                    except (KeyboardInterrupt, SystemExit):
                        raise  # asks the process to stop, not this request
                    except BaseException as err:  # noqa: BLE001 - fails its own request only
                        # (asyncio's CancelledError is a BaseException: a
                        # listener touching a cancelled future raises it)
                        self._listener_failed(handle, f"a listener raised {described(err)}")
                        continue
                    if returned is not None and inspect.isawaitable(returned):
                        self._listener_async(handle, returned)
        finally:
            self._delivering = False

    def _listener_async(self, handle: Handle, returned: object) -> None:
        """A listener that returned an awaitable (a lambda around an async
        call, an object whose ``__call__`` is async) did none of its work:
        nothing here awaits. Failed like a raise, not dropped in silence."""
        closed(returned)
        self._listener_failed(handle, f"a listener returned {type(returned).__name__}, which nothing "
                                      "awaits: listeners are plain functions run on the decode thread "
                                      "(for asyncio use aquery, astream and the other a-calls)")

    def _listener_failed(self, handle: Handle, reason: str) -> None:
        if handle.result is None and self.scheduler.cancel(handle.request_id, Status.FAILED, reason):
            self._log(("cancel", handle.request_id))
            self._absorb()
        else:
            self.listener_errors.append(f"request {handle.request_id}: {reason}")

    # -------------------------------------------------------------- validation
    def validate(self, req: Request) -> None:
        """Raise ``InvalidRequest`` naming the field if this engine cannot take
        ``req``; pure (no state changes), so any thread may call it."""
        cap, vocab = self.backend.capacity, self.backend.vocab_size
        if not isinstance(req, Request):
            raise InvalidRequest(f"request: must be a Request, got {type(req).__name__}")
        n = len(req.prompt)
        if n == 0:
            raise InvalidRequest("prompt: must hold at least one token")
        if any(type(t) is not int or not 0 <= t < vocab for t in req.prompt):
            raise InvalidRequest(f"prompt: token ids must be ints in [0, {vocab})")
        if type(req.max_tokens) is not int or req.max_tokens < 1:
            raise InvalidRequest(f"max_tokens: must be an int >= 1, got {req.max_tokens!r}")
        if any(type(t) is not int or not 0 <= t < vocab for t in req.stop_ids):
            raise InvalidRequest(f"stop_ids: token ids must be ints in [0, {vocab})")
        if not isinstance(req.sampling, SamplingParams):
            raise InvalidRequest(f"sampling: must be SamplingParams, got {type(req.sampling).__name__}")
        for name in ("decode_state", "finisher"):
            if getattr(req, name) is not None and not callable(getattr(req, name)):
                raise InvalidRequest(f"{name}: must be callable or None")
        if req.image is not None:
            if not isinstance(req.image, ImageRef):
                raise InvalidRequest(f"image: must be an ImageRef or None, got {type(req.image).__name__}")
            if not cap.images:
                raise InvalidRequest("image: this backend takes no images")
            if type(req.image.length) is not int or req.image.length < 1:
                raise InvalidRequest(f"image: length must be an int >= 1, got {req.image.length!r}")
        why = bad_prompt_values(req.prompt_values, n, cap.values)
        if why is not None:
            raise InvalidRequest(f"prompt_values: {why}")
        # An image's prefix shares the prompt's prefill budget, context and pages.
        image = "" if req.image is None else f"image ({req.image.length}) + "
        if req.prefix_len > cap.max_prefill_tokens:
            if req.image is not None and req.image.length >= cap.max_prefill_tokens:  # no text could fit
                raise InvalidRequest(f"image: {req.image.length} positions, which leave no room for a prompt "
                                     f"in the {cap.max_prefill_tokens} one prefill takes")
            size = f"{n} tokens" if not image else f"{req.prefix_len} tokens with the image's {req.image.length}"
            raise InvalidRequest(f"prompt: {size}, more than the {cap.max_prefill_tokens} one prefill takes")
        if req.prefix_len + req.max_tokens > cap.max_context:
            raise InvalidRequest(f"max_tokens: {image}prompt ({n}) + max_tokens ({req.max_tokens}) exceeds "
                                 f"the context ({cap.max_context})")
        need = pages_needed(req.prefix_len, req.max_tokens, cap.page_size)
        if need > cap.num_pages:
            raise InvalidRequest(f"max_tokens: needs {need} KV pages, the cache has {cap.num_pages}")
        if req.adapter is not None and cap.num_adapter_slots == 0:
            raise InvalidRequest("adapter: this backend has no adapter slots")


LISTENER_ERRORS_KEPT = 100
BEHIND_KEPT = 256
