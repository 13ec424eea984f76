"""A public ``bubblefree.Engine`` on the simulated GPU, for the serving tests.

The model never samples EOS, so a request runs exactly to its ``max_tokens``
(or its skill's end): its length is the test's choice, not the model's. A
``Gate`` can hold the decode thread inside a step, as a slow GPU would: a
test that must act while a request is certainly still running (cancel it,
close its stream, close its event loop) arms the gate, acts while the
thread is held, then opens it. That is synchronization by condition, not by
timing, so it holds on a loaded machine.

Reference outputs come from a request run alone on its own engine: the fake
model is a pure function of (prompt, position, previous token), so a request
that shares its steps with others must get exactly those tokens (I8).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import attrs
import pytest

from bubblefree import Engine
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import SamplingParams
from bubblefree.fake_backend import FakeBackend, FakeModel
from bubblefree.fake_backend.model import EOS_BOTTOM
from bubblefree.skills import LocationCodec, SkillSet, demo_tokenizer
from bubblefree.skills.registry import BUILTIN, Registry
from bubblefree.skills.text import Query, TextState

TOK = demo_tokenizer(coord_bins=64, size_bins=16)
GATE_WORD = TOK.words.index("sky")  # a prompt holding this word can be held at the gate
WAIT = 30.0  # seconds: generous, for a loaded machine; every wait is for a condition


class Unprintable(Exception):
    """A caller's or a skill's exception whose message itself raises."""

    def __str__(self):
        raise RuntimeError("no message")


class Gate:
    """Holds the decode thread when it samples a gated request's ``at``-th
    output token, until ``open()``; at most once per ``arm()``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self._released = threading.Event()
        self._armed = False
        self._at = 0

    def arm(self, at: int = 2) -> "Gate":
        self._at, self._armed = at, True
        self.reached.clear()
        self._released.clear()
        return self

    def open(self) -> None:
        self._armed = False
        self._released.set()

    def check(self, prompt: tuple[int, ...], position: int) -> None:
        if self._armed and GATE_WORD in prompt and position - len(prompt) == self._at:
            self._armed = False
            self.reached.set()
            self._released.wait(WAIT)

    def wait_reached(self) -> None:
        assert self.reached.wait(WAIT), "the gated request never reached the gate"


def endless_model(gate: Gate | None = None) -> FakeModel:
    base = FakeModel(vocab_size=len(TOK), eos_id=TOK.eos_id)

    def scores(prompt, position, prev):
        if gate is not None:
            gate.check(prompt, position)
        out = list(base.scores(prompt, position, prev))
        out[TOK.eos_id] = EOS_BOTTOM
        return out

    return FakeModel(vocab_size=len(TOK), eos_id=TOK.eos_id, score_fn=scores)


def make_engine(*, gate: Gate | None = None, registry: Registry = BUILTIN, pipelined: bool = True,
                **backend: Any) -> Engine:
    options = dict(num_pages=256, max_rows=8, max_seqs=16)
    options.update(backend)
    core = CoreEngine(FakeBackend(model=endless_model(gate), **options), pipelined=pipelined,
                      trace_limit=50_000)
    skills = SkillSet(TOK, core.register_mask, codec=LocationCodec.for_tokenizer(TOK, coord_bins=64, size_bins=16),
                      registry=registry).compile_all()
    return Engine(core, skills)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(0.002)


def idle(engine: Engine) -> bool:
    scheduler = engine.core.scheduler
    return scheduler.pages.num_free == scheduler.pages.size and scheduler.rows.num_free == scheduler.rows.size


def wait_idle(engine: Engine) -> None:
    """I6 at the edge: once every request has ended and its last step
    committed, every KV page and row slot is free again."""
    wait_until(lambda: idle(engine), "every page and row slot back")
    engine.core.scheduler.pages.check_integrity()
    engine.core.scheduler.rows.check_integrity()


def question_of(handle) -> str:
    """The question a query was submitted with, read back from its prompt."""
    words = TOK.decode(handle.request.prompt).split()
    return " ".join(words[words.index("Question:") + 1:words.index("Answer:")])


def assert_serves(engine: Engine) -> None:
    """A fresh request completes with the tokens it gets alone."""
    handle = engine.submit("query", question="is there a cat", max_tokens=4)
    assert handle.result(WAIT).tokens == reference("query", {"question": "is there a cat"}, None, 4)


_REFERENCE: dict[tuple, tuple[int, ...]] = {}
_REFERENCE_ENGINES: dict[int, Engine] = {}


def reference(skill: str, args: dict, sampling: SamplingParams | dict | None, max_tokens: int | None,
              registry: Registry = BUILTIN) -> tuple[int, ...]:
    """The tokens of this request run alone (cached; one engine per registry)."""
    key = (skill, tuple(sorted(args.items())), repr(SamplingParams.of(sampling)), max_tokens, id(registry))
    if key not in _REFERENCE:
        engine = _REFERENCE_ENGINES.get(id(registry))
        if engine is None:
            engine = _REFERENCE_ENGINES[id(registry)] = make_engine(registry=registry)
        handle = engine.submit(skill, sampling=sampling, max_tokens=max_tokens, **args)
        _REFERENCE[key] = handle.result(WAIT).tokens
    return _REFERENCE[key]


class Ends:
    """Counts end events (the listener's ``None``) per request id: I7 says
    exactly one each. Thread-safe; it also forwards to an optional listener."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[int, int] = {}

    def listener(self, then: Callable | None = None) -> Callable:
        def listen(handle, token):
            if token is None:
                with self._lock:
                    self.counts[handle.request_id] = self.counts.get(handle.request_id, 0) + 1
            if then is not None:
                then(handle, token)
        return listen

    def wait_all(self, handles) -> None:
        ids = [h.request_id for h in handles]
        wait_until(lambda: all(self.counts.get(i, 0) >= 1 for i in ids), "every end listener called")
        twice = {i: self.counts[i] for i in ids if self.counts[i] != 1}
        assert not twice, f"I7: requests ended more than once: {twice}"


# -- skills that misbehave, each a ``Query`` with one duty broken ------------

@attrs.define
class _OddState(TextState):
    odd: Callable[[TextState, int], Any] | None = None
    mask: Any = "text"

    def mask_id(self):
        return self.tables.mask if self.mask == "text" else self.mask

    def advance(self, token: int, value: float | None = None) -> bool:
        done = super().advance(token, value)
        return self.odd(self, token) if self.odd is not None else done


@attrs.frozen
class OddQuery(Query):
    """``query`` whose state returns ``mask`` from ``mask_id()`` and, when
    given, lets ``odd(state, token)`` decide ``advance``'s answer (or raise)."""

    name: str = "odd"
    mask: Any = "text"
    odd: Callable | None = None

    def start(self, tables, args, budget):
        return _OddState(tables, odd=self.odd, mask=self.mask)


def _divide_by_zero(state, token):
    raise ZeroDivisionError("no room left in the answer")


ODD = BUILTIN.with_skill(
    OddQuery(name="unregistered_mask", mask=10**6),
    OddQuery(name="str_mask", mask="0"),
    OddQuery(name="bool_mask", mask=True),
    OddQuery(name="raising_skill", odd=_divide_by_zero),
)


# Fixtures for the files that import them: a plain engine, and one whose
# decode thread holds at the gate word until the test opens the gate.
GATED = "is the sky blue"  # holds the gate word


@pytest.fixture
def engine():
    eng = make_engine()
    yield eng
    eng.close()


@pytest.fixture
def gate():
    return Gate()


@pytest.fixture
def gated(gate):
    eng = make_engine(gate=gate)
    yield eng
    gate.open()
    eng.close()
