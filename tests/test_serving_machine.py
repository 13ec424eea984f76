"""The public ``bubblefree.Engine`` under a random mix of everything callers do.

Hypothesis drives one engine through submits (good values and bad),
``submit_many``, cancels from other threads and from listeners, listeners
that raise, streams dropped half read, asyncio tasks cancelled, event loops
closed under a running request, and pipelined/blocking/auto switches, while the
decode thread keeps running. Every submission carries an end counter.

Checked after every rule: no request has ended twice (I7), every ended
request that completed holds exactly the tokens it gets when run alone, and
one that was cut holds a prefix of them (I8); a refused submit changed
nothing (the next accepted request takes the next id). At ``settle`` and at
the end: every request ended exactly once, requests nobody touched
completed, every page and row slot is back (I6), and a fresh query
completes. Once over the simulated GPU, once (smaller) over the CPU
backend with a tiny random Llama.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bubblefree import InvalidRequest, RequestFailed, Status
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import SamplingParams
from bubblefree.skills import LocationCodec, SkillSet
from tests.serving_world import TOK, WAIT, Ends, make_engine, reference, wait_idle

QUESTIONS = ("the cat", "a dog sits", "red car", "what colour is the mat")
GOOD_SAMPLING = st.sampled_from([None, {"temperature": 0.7, "seed": 1}, {"temperature": 1, "top_p": 0.9},
                                 SamplingParams(temperature=0.5, seed=9),
                                 {"temperature": 1.2, "top_k": 5, "min_p": 0.02, "seed": 4}])
BAD = st.sampled_from([
    dict(sampling={"temperature": float("nan")}), dict(sampling={"temperature": "hot"}),
    dict(sampling={"seed": 1.5}), dict(sampling={"bogus": 1}), dict(sampling="greedy"),
    dict(max_tokens=True), dict(max_tokens=0), dict(question="\ud800"), dict(listener="no"),
])


@st.composite
def calls(draw, max_tokens=24):
    skill = draw(st.sampled_from(["query", "query", "caption", "point", "detect"]))
    args = {"query": lambda: {"question": draw(st.sampled_from(QUESTIONS))},
            "caption": lambda: {"length": "short"},
            "point": lambda: {"object": "the cat"},
            "detect": lambda: {"object": "a dog"}}[skill]()
    return skill, args, draw(GOOD_SAMPLING), draw(st.integers(1, max_tokens))


class Tracked:
    """A submission and what it may end as."""

    def __init__(self, call, touched: bool):
        self.skill, self.args, self.sampling, self.max_tokens = call
        self.touched = touched  # cancelled, raised at, abandoned: may end early
        self.handle = None


class ServingMachine(RuleBasedStateMachine):
    max_tokens = 24

    def build(self):
        return make_engine()

    def reference(self, t: Tracked):
        # The sampling the engine accepted: a drawn request sent without a seed got its own.
        return reference(t.skill, t.args, t.handle.request.sampling, t.max_tokens)

    def __init__(self):
        super().__init__()
        self.engine = self.build()
        self.ends = Ends()
        self.tracked: list[Tracked] = []
        self.accepted = 0  # request ids are handed out in acceptance order
        # Every Handle the engine hands out, whoever asked (arun and astream
        # keep theirs inside): recorded at the one door they all go through.
        self.returned: list = []
        submit_many = self.engine.submit_many

        def recording(calls):
            handles = submit_many(calls)
            self.returned.extend(handles)
            return handles
        self.engine.submit_many = recording

    # -------------------------------------------------------------- helpers
    def _accept(self, t: Tracked, handle) -> None:
        assert handle.request_id == self.accepted, "a refused submit took an id"
        self.accepted += 1
        t.handle = handle
        self.tracked.append(t)

    def _submit(self, call, touched=False, then=None):
        t = Tracked(call, touched)
        self._accept(t, self.engine.submit(t.skill, sampling=t.sampling, max_tokens=t.max_tokens,
                                           listener=self.ends.listener(then), **t.args))
        return t

    # ---------------------------------------------------------------- rules
    @rule(call=calls())
    def submit(self, call):
        self._submit(call)

    @rule(bad=BAD, call=calls())
    def submit_bad(self, bad, call):
        skill, args, sampling, max_tokens = call
        kw = dict(args, sampling=sampling, max_tokens=max_tokens)
        if "question" in bad:
            skill = "query"
        kw.update(bad)
        with pytest.raises(InvalidRequest):
            self.engine.submit(skill, **kw)

    @rule(many=st.lists(calls(), min_size=1, max_size=4))
    def submit_many(self, many):
        ts = [Tracked(c, False) for c in many]
        handles = self.engine.submit_many([(t.skill, dict(t.args, sampling=t.sampling, max_tokens=t.max_tokens,
                                                          listener=self.ends.listener())) for t in ts])
        for t, h in zip(ts, handles):
            self._accept(t, h)

    # Which requests are still live depends on the decode thread's timing, so
    # the target is drawn among all (a cancel after the end changes nothing).
    @precondition(lambda self: self.tracked)
    @rule(pick=st.integers(0, 1 << 16))
    def cancel_from_another_thread(self, pick):
        t = self.tracked[pick % len(self.tracked)]
        t.touched = True
        thread = threading.Thread(target=self.engine.cancel, args=(t.handle,))
        thread.start()
        thread.join(WAIT)
        assert not thread.is_alive()

    @rule(call=calls(), at=st.integers(1, 4))
    def cancel_from_a_listener(self, call, at):
        def cancel_at(handle, token):
            if token is not None and len(handle.tokens) == at:
                assert handle.cancel()
        self._submit(call, touched=True, then=cancel_at)

    @rule(call=calls(), at=st.one_of(st.none(), st.integers(1, 4)))
    def raising_listener(self, call, at):
        """Raises at its ``at``-th token, or at its end (None): the latter
        cannot change how the request ended, so it is not touched."""
        def boom(handle, token):
            if (token is None) if at is None else len(handle.tokens) == at:
                raise ValueError("boom")
        self._submit(call, touched=at is not None, then=boom)

    @rule(call=calls(), read=st.integers(0, 2))
    def abandon_a_stream(self, call, read):
        skill, args, sampling, max_tokens = call
        if skill not in ("query", "caption"):
            skill, args = "query", {"question": QUESTIONS[0]}
        t = Tracked((skill, args, sampling, max_tokens), True)
        stream = self.engine.stream(skill, sampling=sampling, max_tokens=max_tokens,
                                    listener=self.ends.listener(), **args)
        self._accept(t, stream.handle)
        try:
            for _ in range(read):
                next(stream)
        except StopIteration:
            pass
        del stream
        gc.collect()

    @rule(call=calls(), how=st.sampled_from(["arun", "astream"]), turns=st.integers(0, 3))
    def cancel_an_asyncio_task(self, call, how, turns):
        t = Tracked(call, True)
        before = len(self.returned)

        async def consume():
            kw = dict(t.args, sampling=t.sampling, max_tokens=t.max_tokens, listener=self.ends.listener())
            if how == "arun":
                return await self.engine.arun(t.skill, **kw)
            return [p async for p in self.engine.astream(t.skill, **kw)]

        async def main():
            task = asyncio.ensure_future(consume())
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, RequestFailed):
                pass

        asyncio.run(main())
        self._track_returned(t, before)

    @rule(call=calls())
    def close_the_event_loop_mid_request(self, call):
        t = Tracked(call, True)
        before, started = len(self.returned), threading.Event()

        loop = asyncio.new_event_loop()
        task = loop.create_task(self.engine.arun(t.skill, sampling=t.sampling, max_tokens=t.max_tokens,
                                                 listener=self.ends.listener(lambda h, tok: started.set()), **t.args))
        loop.run_until_complete(loop.run_in_executor(None, started.wait, WAIT))
        loop.close()  # the task is left pending: its loop is gone
        del task
        self._track_returned(t, before)

    def _track_returned(self, t: Tracked, before: int) -> None:
        """An asyncio call's handle (none when its task was cancelled before
        its first turn: it never submitted)."""
        new = self.returned[before:]
        assert len(new) <= 1
        if new:
            self._accept(t, new[0])

    @rule(pipelined=st.sampled_from([True, False, "auto"]))
    def switch_pipelined(self, pipelined):
        self.engine.pipelined = pipelined
        assert self.engine.pipelined is pipelined or self.engine.pipelined == pipelined == "auto"

    @rule()
    def settle(self):
        self._quiesce()

    # ----------------------------------------------------------- invariants
    @invariant()
    def ended_requests_are_whole_or_a_prefix(self):
        for t in self.tracked:
            assert self.ends.counts.get(t.handle.request_id, 0) <= 1, "I7: ended twice"
            if not t.handle.done:
                continue
            result, full = t.handle.result(0), self.reference(t)
            if result.status is Status.COMPLETED:
                assert result.tokens == full, (t.skill, t.args, t.sampling)
            else:
                assert t.touched, f"an untouched request ended {result.status}: {result.finish_reason}"
                assert result.tokens == full[:len(result.tokens)]

    @invariant()
    def still_running(self):
        assert self.engine.loop.running, self.engine.loop._error

    def _quiesce(self):
        self.still_running()  # fail now rather than after every bounded wait
        self.ends.wait_all([t.handle for t in self.tracked])
        for t in self.tracked:
            assert t.handle.result(0) is not None
        wait_idle(self.engine)
        assert_serves_on(self)

    def teardown(self):
        try:
            self._quiesce()
        finally:
            self.engine.close()


def assert_serves_on(machine: ServingMachine) -> None:
    call = ("query", {"question": "the cat"}, None, 3)
    t = Tracked(call, False)
    machine._accept(t, machine.engine.submit("query", question="the cat", max_tokens=3,
                                             listener=machine.ends.listener()))
    assert t.handle.result(WAIT).tokens == machine.reference(t)
    machine.ends.wait_all([t.handle])


ServingMachine.TestCase.settings = settings(deadline=None, max_examples=30, stateful_step_count=25)
test_serving_on_the_simulated_gpu = ServingMachine.TestCase


# -- the CPU backend: a tiny random Llama -------------------------------------

def _cpu_engine():
    from bubblefree import Engine
    from bubblefree.cuda_backend.backend import CudaBackend
    from bubblefree.cuda_backend.tiny import tiny_model

    backend = CudaBackend(tiny_model("llama", seed=3, vocab_size=len(TOK)), page_size=4, num_pages=160,
                          max_rows=4, max_seqs=8, max_prefill_tokens=64, min_graph_context=8)
    core = CoreEngine(backend, trace_limit=10_000)
    skills = SkillSet(TOK, core.register_mask,
                      codec=LocationCodec.for_tokenizer(TOK, coord_bins=64, size_bins=16)).compile_all()
    return Engine(core, skills, backend=backend)


class CpuServingMachine(ServingMachine):
    max_tokens = 8
    _reference_engine = None
    _references: dict = {}

    def build(self):
        return _cpu_engine()

    def reference(self, t: Tracked):
        sampling = t.handle.request.sampling  # as accepted: with the seed drawn for it, if any
        key = (t.skill, tuple(sorted(t.args.items())), repr(sampling), t.max_tokens)
        if key not in self._references:
            if CpuServingMachine._reference_engine is None:
                CpuServingMachine._reference_engine = _cpu_engine()
            h = self._reference_engine.submit(t.skill, sampling=sampling, max_tokens=t.max_tokens, **t.args)
            self._references[key] = h.result(WAIT).tokens
        return self._references[key]


CpuServingMachine.TestCase.settings = settings(deadline=None, max_examples=6, stateful_step_count=10)
test_serving_on_the_cpu_backend = CpuServingMachine.TestCase
