"""One state of the exhaustive search: an Engine on a FakeBackend, plus the
choices still open (arrivals, cancels, faults), and every invariant check.

``World.key()`` is the canonical abstract state the search deduplicates on.
It holds everything the future can depend on and nothing that is only
history: phases, tokens, refs, in-flight steps, slot states, the queue, the
allocators' free lists (their order decides the next allocation), the
simulated device (KV, row tokens, slots), its timeline *relative to the
host clock* (a queue that is already idle is the same whatever its past),
and the arrivals and cancels still to come. Step ids are stored relative to
the next one, so two states that differ only in how many steps came before
are one state.
"""

from __future__ import annotations

import attrs

from bubblefree.core import Engine, InvariantViolation, Phase, Request, SlotState, Status
from bubblefree.core.ahead import choose, launch_ahead, outlook
from bubblefree.core.sequence import ENDED
from bubblefree.fake_backend import FakeBackend, FakeModel

if __package__:  # python -m tests.exhaustive
    from tests.exhaustive_workload import DONE_AFTER, TIMINGS, VOCAB, Bounds, expected
else:
    from exhaustive_workload import DONE_AFTER, TIMINGS, VOCAB, Bounds, expected


@attrs.define(eq=False)
class PhaseChecked(Engine):
    """The real Engine, with ``check_integrity`` after each phase of a tick as
    well as between ticks: mid-tick is where a sequence sits in two steps
    and both slots are busy (I3's bound of 2, I4), never seen at tick ends."""

    def _launch(self) -> bool:
        done = super()._launch()
        self.check_integrity()
        return done

    def _commit(self) -> bool:
        done = super()._commit()
        self.check_integrity()
        return done

    def _finalize(self) -> bool:
        done = super()._finalize()
        self.check_integrity()
        return done

    def _learn(self) -> None:
        """Auto learns each row's end from the ``SequenceEnded`` events since
        its choice: in every state the tally must be the rows' own (each
        ended, or gone, by now)."""
        seqs = self.scheduler.seqs
        own = {key: sum(1 for sid in sids if (q := seqs.get(sid)) is None or q.phase in ENDED)
               for key, sids in self._may_end.items()}
        told = {key: len(self._ended.intersection(sids)) for key, sids in self._may_end.items()}
        if own != told:
            raise InvariantViolation(f"auto's end tally {told} is not its rows' own {own}")
        super()._learn()


@attrs.define(eq=False)
class Choosing(PhaseChecked):
    """The auto mode with a choice oracle: the search sets ``oracle`` before
    each tick, for the choice at its end: ahead (True, the step finalized
    stays in flight) or behind (False, it commits now), so mixed ticks of
    every policy are explored at once. The engine's own choice still runs
    (its outlook must leave the state untouched) and is overruled."""

    oracle: bool | None = None

    def _ahead(self) -> bool:
        before = scheduler_state(self.scheduler)
        own = super()._ahead()
        if scheduler_state(self.scheduler) != before:
            raise InvariantViolation("I8: the auto rule's outlook changed the state it looked at")
        check_shortcut(self)
        return own if self.oracle is None else self.oracle


# Timings and callers' shares the shortcut is checked at in every state, on
# both sides of the rule's line and on it (a bubble of half a forward), with
# and without a prefill launch costlier than a decode's.
SHORTCUT_GRID = tuple((b, f, share, extra) for b in (0.0, 0.5, 2.0) for f in (0.0, 1.0)
                      for share in (0.0, 0.5, 1.0, 2.0) for extra in (0.0, 0.25))


def check_shortcut(engine: Engine) -> None:
    """``choose`` foresees the next step only where the answer depends on it:
    its answer and rows must be the rule's on the whole ``outlook``, here
    and at every timing of ``SHORTCUT_GRID``, against the bubble weighed
    with the expected ends (``outlook``'s z with every row weighted 1) and
    the rows left live;
    the zombies it names give its answer, at least the outlook's where
    ahead and at most where behind."""
    sched, rates, t = engine.scheduler, engine.end_rates, engine.timings
    own = (t.bubble, t.forward or 0.0, engine.successors.rate, t.prefill_extra)
    before = scheduler_state(sched)
    looks = {1.0: outlook(sched, rates, 1.0)}  # by share: the whole outlook depends on no timing
    ends = looks[1.0][1]
    for bubble, forward, share, extra in (own,) + SHORTCUT_GRID:
        if share not in looks:
            looks[share] = outlook(sched, rates, share)
        rows, zombies, may = looks[share]
        weighed = bubble + (min(1.0, share * ends * (rows - 1) / rows) * extra * max(0.0, rows - ends) / rows
                            if rows else 0.0)
        exact = launch_ahead(rows, zombies, weighed, forward)
        got = choose(sched, rates, share, bubble, forward, extra)
        named = got.zombies - zombies if got.ahead else zombies - got.zombies
        if (got.ahead, got.may, got.rows) != (exact, may, rows) or \
                named < -1e-9 * max(1.0, zombies) or abs(got.bubble - weighed) > 1e-9 * max(1.0, weighed) or \
                launch_ahead(got.rows, got.zombies, got.bubble, forward) != got.ahead:
            raise InvariantViolation(f"the auto rule's shortcut gave {got}, the whole outlook "
                                     f"{(exact, may, rows, zombies, weighed)} (bubble {bubble}, forward "
                                     f"{forward}, share {share}, prefill extra {extra})")
    if scheduler_state(sched) != before:
        raise InvariantViolation("I8: the auto rule's shortcut changed the state it looked at")


def scheduler_state(s) -> tuple:
    """What a look at the scheduler must leave as it was: the queue, each
    sequence's phase and resources, the pools, the steps in flight, the
    events not yet taken and the step ids and kinds planned so far."""
    seqs = tuple((sid, q.phase, q.row_slot, q.pages, q.adapter_slot, q.inflight_refs, q.launched, len(q.tokens))
                 for sid, q in sorted(s.seqs.items()))
    return (tuple(s.queue), seqs, s.pages.num_free, s.rows.num_free, s.adapters.num_free,
            tuple(st.step_id for st in s.inflight), len(s.events), s._next_step, s._last_kind)


@attrs.define(eq=False)
class Watcher:
    """A handle listener: counts ends (I7) and tokens streamed after the end
    (I5). Armed, it cancels a request when its own request's next token is
    streamed: a caller's stop condition, run inside the commit (reentrancy)."""

    request_id: int
    engine: Engine
    ends: int = 0
    late_tokens: int = 0
    checked: bool = False  # its result was checked against the model (I8)
    arm: int | None = None  # the request to cancel on the next token

    def __call__(self, handle, token) -> None:
        if handle.request_id != self.request_id:
            raise InvariantViolation(f"I7: request {self.request_id}'s listener called with {handle.request_id}")
        if token is None:
            self.ends += 1
        elif self.ends:
            self.late_tokens += 1
        elif self.arm is not None:
            target, self.arm = self.arm, None
            self.engine.cancel(target)


@attrs.define(eq=False)
class World:
    engine: Engine
    backend: FakeBackend
    bounds: Bounds
    handles: list = attrs.Factory(list)  # every submitted Handle, by seq id
    watchers: list = attrs.Factory(list)
    tick_no: int = 0
    cancels_left: int = 0
    faults_left: int = 0

    @classmethod
    def new(cls, bounds: Bounds, pipelined: bool | str, probe) -> "World":
        """``pipelined``: True, False, "auto", or "choice" (auto with the oracle)."""
        backend = FakeBackend(
            model=FakeModel(vocab_size=VOCAB), timing=TIMINGS[bounds.timings[0]], num_pages=bounds.num_pages,
            page_size=bounds.page_size, max_rows=bounds.max_rows, max_seqs=bounds.requests,
            max_prefill_tokens=bounds.max_prefill_tokens,
            max_context=bounds.max_context, num_adapter_slots=bounds.adapter_slots, image_length=2)
        clock = lambda: backend.clock.host  # noqa: E731 - virtual time: the auto mode's measurements replay
        if pipelined == "choice":
            engine = Choosing(backend, pipelined="auto", probe=probe, clock=clock)
        else:
            engine = PhaseChecked(backend, pipelined=pipelined, probe=probe, clock=clock)
        return cls(engine, backend, bounds, cancels_left=bounds.cancels, faults_left=int(bool(bounds.faults)))

    # ----------------------------------------------------------------- moves
    def submit(self, request: Request) -> None:
        handle = self.engine.submit(request)
        watcher = Watcher(handle.request_id, self.engine)
        handle.listeners.append(watcher)
        self.handles.append(handle)
        self.watchers.append(watcher)

    def cancel(self, how: int | tuple[int, int]) -> None:
        """``seq_id``: cancel it now; ``(seq_id, by)``: when ``by`` streams its next token."""
        self.cancels_left -= 1
        if isinstance(how, tuple):
            self.watchers[how[1]].arm = how[0]
        elif not self.engine.cancel(how):
            raise InvariantViolation(f"I7: cancel of live request {how} refused")

    def live(self) -> list[int]:
        return [h.request_id for h in self.handles if h.result is None]

    def arrivals_open(self) -> bool:
        return len(self.handles) < self.bounds.requests and self.tick_no <= self.bounds.last_arrival

    def terminal(self) -> bool:
        return len(self.handles) == self.bounds.requests and not self.engine.has_work()

    # ------------------------------------------------------------------- key
    def key(self) -> tuple:
        s, b = self.engine.scheduler, self.backend
        base, host = s._next_step, b.clock.host

        def rel(step_id):
            return None if step_id is None or step_id < 0 else base - step_id

        def ahead(t):  # a time already past is the same as now
            return max(0.0, t - host)

        seqs = tuple(
            (q.seq_id, q.phase.value, q.inflight_refs, tuple(q.tokens), q.launched, q.pages, q.row_slot, q.adapter_slot,
             q.finish_reason, rel(q.last_step), getattr(q.state, "got", None))
            for q in sorted(s.seqs.values(), key=lambda q: q.seq_id))
        steps = tuple((rel(st.step_id), st.kind.value, st.slot, st.seq_ids, st.mask_ids, st.failed)
                      for st in s.inflight)
        pools = tuple((tuple(p._free), tuple(sorted(p._owned))) for p in (s.pages, s.rows, s.adapters))
        slots = tuple(
            (sl.state.value, rel(sl.plan.step_id if sl.plan else None), ahead(sl.copy_end),
             sl.host_buffer is not None, sl.fault)
            for sl in b.slots)
        # KV and row tokens only where a live sequence owns them: what a free
        # page or row slot holds is garbage to a correct engine, and a wrong
        # read of it raises whatever the garbage is (another sequence's, or none).
        pages, rows = s.pages._owned, s.rows._owned
        device = (tuple(sorted(kv for kv in b.memory.kv.items() if kv[0][0] in pages)),
                  tuple(sorted(rt for rt in b.memory.row_tokens.items() if rt[0] in rows)),
                  rel(b._last_step_id), ahead(b.clock.compute.free_at), ahead(b.clock.copy.free_at),
                  b.owners.key(host, rel))
        # An ended request was checked when it ended (check_state): only that
        # it ended, how, and that nothing came after stays in the key.
        outside = tuple((tuple(h.tokens) if h.result is None else h.result.status, w.ends, w.late_tokens, w.arm)
                        for h, w in zip(self.handles, self.watchers))
        to_come = (max(0, self.bounds.last_arrival - self.tick_no) if self.arrivals_open() else -1,
                   self.cancels_left, self.faults_left)
        return (seqs, steps, pools, tuple(s.queue), s._last_kind, tuple(sorted(s._waited)),
                tuple(sl.state.value for sl in s.pool.slots), slots, device, outside, to_come)

    # ---------------------------------------------------------------- checks
    def check_tick(self, trace_from: int, inflight_before: list[int]) -> None:
        """I2 from the trace of one tick: each commit is the oldest launched,
        uncommitted step at that moment."""
        open_steps = list(inflight_before)
        for entry in self.engine.trace[trace_from:]:
            if entry[0] == "launch":
                open_steps.append(entry[1])
            elif entry[0] == "commit":
                if not open_steps or entry[1] != min(open_steps):
                    raise InvariantViolation(f"I2: step {entry[1]} committed while {open_steps} were open")
                open_steps.remove(entry[1])

    def check_device(self, compute_free_before: float) -> None:
        """I1 on this tick's compute queue: one item at a time, each starting
        after the one before ended, forwards in step order."""
        prev_end, last_forward = compute_free_before, None
        for step_id, what, start, end in self.backend.clock.compute.intervals:
            if start < prev_end or (what == "forward" and last_forward is not None and step_id <= last_forward):
                raise InvariantViolation(f"I1: {what} of step {step_id} overlaps or overtakes the compute queue")
            prev_end, last_forward = end, step_id if what == "forward" else last_forward

    def check_state(self) -> None:
        """Every invariant the core keeps, in any reachable state."""
        self.engine.check_integrity()  # I2, I3, I4, I6 structure
        s = self.engine.scheduler
        for pool, field in ((s.pages, "pages"), (s.rows, "row_slot"), (s.adapters, "adapter_slot")):
            held: list[int] = []
            for q in s.seqs.values():
                v = getattr(q, field)
                held.extend(v if isinstance(v, tuple) else () if v is None else (v,))
            if sorted(held) != sorted(pool._owned):
                raise InvariantViolation(f"I6: sequences hold {field} {sorted(held)}, pool owns {sorted(pool._owned)}")
        for q in s.seqs.values():
            if q.finalized and not q.is_zombie:
                raise InvariantViolation(f"I6: sequence {q.seq_id} finalized with no step in flight, not released")
        for core_slot, dev in zip(s.pool.slots, self.backend.slots):
            ok = {SlotState.FREE: ("free",), SlotState.LAUNCHED: ("launched",),
                  SlotState.FINALIZED: ("finalized", "failed")}[core_slot.state]
            if dev.state.value not in ok:
                raise InvariantViolation(f"I4: core slot {core_slot.index} {core_slot.state.name}, device {dev.state.name}")
        for h, w in zip(self.handles, self.watchers):
            req, toks = h.request, h.tokens
            if len(toks) > req.max_tokens or any(t in req.stop_ids for t in toks[:-1]) or w.late_tokens:
                raise InvariantViolation(f"I5: request {h.request_id} streamed {toks} (late: {w.late_tokens})")
            if w.ends > 1 or (w.ends == 1) != (h.result is not None):
                raise InvariantViolation(f"I7: request {h.request_id} ended {w.ends} times")
            if h.result is not None and list(h.result.tokens) != toks:
                raise InvariantViolation(f"I7: request {h.request_id} result {h.result.tokens} != streamed {toks}")
            if h.result is not None and not w.checked:
                self.check_result(h)
                w.checked = True
            seq = s.seqs.get(h.request_id)
            if h.result is None and (seq is None or seq.finalized):
                raise InvariantViolation(f"I7: request {h.request_id} lost: no result and not live")
            if seq is not None and seq.phase is Phase.RELEASED:
                raise InvariantViolation(f"I6: released sequence {seq.seq_id} still in the engine")
        for q in s.seqs.values():  # after the ends: a skill's own raise is reported as such first
            if q.state is not None and q.state.got != tuple(q.tokens):
                raise InvariantViolation(f"skill: sequence {q.seq_id}'s skill received {q.state.got}, "
                                         f"committed {q.tokens}")

    def check_terminal(self) -> None:
        """Every path ends: all answered, nothing in flight, all freed; I8."""
        s, b = self.engine.scheduler, self.backend
        if s.seqs or s.inflight or s.queue or self.engine.handles:
            raise InvariantViolation(
                f"termination: idle with seqs {sorted(s.seqs)}, {len(s.inflight)} steps in flight, queue {list(s.queue)}")
        if any(p.num_free != p.size for p in (s.pages, s.rows, s.adapters)):
            raise InvariantViolation(f"I6: idle with {s.pages.num_owned} pages, {s.rows.num_owned} row slots, "
                                     f"{s.adapters.num_owned} adapter slots held")
        if any(sl.state.value != "free" for sl in b.slots):
            raise InvariantViolation("I4: idle with a device slot not released")
        for h, w in zip(self.handles, self.watchers):
            if h.result is None or w.ends != 1 or not w.checked:
                raise InvariantViolation(f"I7: request {h.request_id} ended {w.ends} times")

    def check_result(self, h) -> None:
        """I8 and the finish reason, once, when a request ends."""
        res = h.result
        if res.status is Status.FAILED and not res.finish_reason.endswith(" fault"):
            # Only an injected fault may fail a request; a skill's check (I9) ends up here.
            raise InvariantViolation(f"request {h.request_id} failed: {res.finish_reason}")
        want_all = expected(self.backend.model, h.request)
        want = want_all.tokens
        if res.status is Status.COMPLETED and res.tokens != want:
            raise InvariantViolation(f"I8: request {h.request_id} got {res.tokens}, the model says {want}")
        if res.tokens != want[:len(res.tokens)]:
            raise InvariantViolation(f"I8: request {h.request_id} partial {res.tokens} is not a prefix of {want}")
        req = h.request
        ok = {"stop": res.status is Status.COMPLETED and bool(res.tokens) and res.tokens[-1] in req.stop_ids,
              "length": res.status is Status.COMPLETED and len(res.tokens) == req.max_tokens,
              "done": res.status is Status.COMPLETED and req.decode_state is not None and len(res.tokens) == DONE_AFTER,
              "cancelled": res.status is Status.CANCELLED,
              }.get(res.finish_reason, res.status is Status.FAILED and res.finish_reason.endswith(" fault"))
        want_output = None if req.finisher is None else ("cycle2", res.tokens, want_all.values[:len(res.tokens)])
        if req.decode_state is not None and res.output != want_output:
            # The skills contract: every committed token reaches advance, in order, once, with the
            # value it asked for (I13), and the values are the model's (I8).
            raise InvariantViolation(f"skill: request {h.request_id}'s skill received {res.output[1:]}, "
                                     f"committed {res.tokens}, the model says {want_output[1:]}")
        if (res.request_id, res.tag, res.output) != (h.request_id, req.tag, want_output):
            raise InvariantViolation(f"I7: request {h.request_id} answered as {res}")
        if not ok:
            raise InvariantViolation(f"I7: request {h.request_id} ended {res.finish_reason!r} with {res.tokens}")
