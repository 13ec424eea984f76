"""Seed replay: a workload drawn from ``random.Random(seed)`` — arrivals,
prompts, EOS positions, constrained and sampled requests, cancels, device
faults and per-step timing — runs to the identical trace every time.

The fingerprint is the sha256 of the engine's event trace and the fake
backend's log (every launch, forward, sampling, copy, wait and release with
its virtual times). Same seed, same hash, also in a fresh process with
another hash salt; other seeds, other hashes (the hash is not constant).
Pipelined and blocking mode give the same tokens (I8), which are the model's.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from bubblefree.core import Engine, Request, SamplingParams, Status
from bubblefree.core.values import GREEDY
from exhaustive_workload import EOS, EVENS, ODDS, VOCAB, Cycle2Factory, cycle2_finish, expected_tokens
from bubblefree.fake_backend import FakeBackend, FakeModel, Fault, Timing, by_step
from bubblefree.fake_backend.timing import FAULT_KINDS

ROOT = Path(__file__).resolve().parent.parent
SEEDS = range(12)


@attrs.frozen
class Spec:
    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int
    constrained: bool
    sampling: SamplingParams
    cancel_at: int | None


@attrs.frozen
class Workload:
    specs: tuple[Spec, ...]
    faults: dict[int, Fault] = attrs.field(hash=False)
    forward: dict[int, float] = attrs.field(hash=False)
    copy: dict[int, float] = attrs.field(hash=False)


def workload(seed: int, *, cancels: bool = True, faults: bool = True) -> Workload:
    """Everything a run depends on, drawn from one seeded RNG."""
    rng = random.Random(seed)
    specs = []
    for _ in range(rng.randint(3, 7)):
        arrival = rng.randint(0, 6)
        # The first prompt token is where EOS falls (0: never; FakeModel).
        prompt = (rng.randint(0, 6),) + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(0, 3)))
        sampling = GREEDY if rng.random() < 0.5 else SamplingParams(
            temperature=rng.choice((0.7, 1.5)), top_p=rng.choice((1.0, 0.8)), seed=rng.randrange(1 << 16))
        cancel_at = arrival + rng.randint(0, 8) if cancels and rng.random() < 0.3 else None
        specs.append(Spec(arrival, prompt, rng.randint(1, 6), rng.random() < 0.3, sampling, cancel_at))
    drawn = {k: Fault(rng.choice(FAULT_KINDS), f"fault at step {k}")
             for k in rng.sample(range(1, 30), rng.randint(1, 3))} if faults else {}
    forward = {k: rng.choice((0.5, 1.0, 4.0)) for k in range(60)}
    copy = {k: rng.choice((0.0, 0.02, 3.0)) for k in range(60)}
    return Workload(tuple(specs), drawn, forward, copy)


@attrs.frozen
class Run:
    digest: str
    results: tuple  # (Result, ...) in submission order
    requests: tuple  # (Request, ...)


def run(w: Workload, pipelined: bool) -> Run:
    backend = FakeBackend(
        model=FakeModel(vocab_size=VOCAB), faults=dict(w.faults),
        timing=Timing(forward=by_step(w.forward, 1.0), copy=by_step(w.copy, 0.02)),
        num_pages=12, page_size=2, max_rows=3, max_seqs=4, max_prefill_tokens=8, max_context=12)
    engine = Engine(backend, pipelined=pipelined)
    mask_ids = (engine.register_mask(EVENS), engine.register_mask(ODDS))
    handles: dict[int, object] = {}
    last_event = max(max(s.arrival, s.cancel_at or 0) for s in w.specs)
    tick = 0
    while True:
        for i, spec in enumerate(w.specs):
            if spec.arrival == tick:
                handles[i] = engine.submit(Request(
                    prompt=spec.prompt, max_tokens=spec.max_tokens, stop_ids={EOS}, sampling=spec.sampling,
                    decode_state=Cycle2Factory(mask_ids) if spec.constrained else None,
                    finisher=cycle2_finish if spec.constrained else None, tag=i))
            if spec.cancel_at == tick and i in handles:
                engine.cancel(handles[i].request_id)
        had_work = engine.has_work()
        busy = engine.tick()
        assert busy == had_work, "tick() is False exactly when there was nothing to do"
        engine.check_integrity()
        tick += 1
        if not busy and tick > last_event:
            break
        assert tick < 1000, "the engine did not drain"
    digest = hashlib.sha256((repr(engine.trace) + repr(backend.log)).encode()).hexdigest()
    order = sorted(handles)
    return Run(digest, tuple(handles[i].result for i in order), tuple(handles[i].request for i in order))


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
@pytest.mark.parametrize("seed", SEEDS)
def test_same_seed_gives_the_identical_trace(seed, pipelined):
    first, second = run(workload(seed), pipelined), run(workload(seed), pipelined)
    assert first.digest == second.digest
    assert first.results == second.results


def test_other_seeds_give_other_traces():
    digests = {run(workload(seed), True).digest for seed in SEEDS}
    assert len(digests) == len(SEEDS), "the trace hash does not depend on the workload"
    assert run(workload(0), True).digest != run(workload(0), False).digest


def test_replay_in_a_fresh_process_with_another_hash_salt():
    # Nothing may depend on Python's per-process string hashing, or on what
    # an earlier run left behind (caches, counters).
    code = ("import test_replay as t; "
            "print(*(t.run(t.workload(s), p).digest for s in (0, 1) for p in (True, False)))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == [run(workload(s), p).digest for s in (0, 1) for p in (True, False)]


@pytest.mark.parametrize("seed", range(30))
def test_I8_pipelined_and_blocking_give_the_same_tokens(seed):
    w = workload(seed, cancels=False, faults=False)
    piped, blocked = run(w, True), run(w, False)
    assert [r.tokens for r in piped.results] == [r.tokens for r in blocked.results]
    for request, result in zip(piped.requests, piped.results):
        assert result.status is Status.COMPLETED
        assert result.tokens == expected_tokens(FakeModel(vocab_size=VOCAB), request)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "blocking"])
@pytest.mark.parametrize("seed", range(30))
def test_I7_I8_with_cancels_and_faults_each_request_ends_once_with_the_model_tokens(seed, pipelined):
    w = workload(seed)
    r = run(w, pipelined)
    model = FakeModel(vocab_size=VOCAB)
    reasons = {f.reason for f in w.faults.values()} | {"cancelled"}
    for i, (request, result) in enumerate(zip(r.requests, r.results)):
        assert result is not None, "I7: a request never ended"
        assert result.tag == i
        want = expected_tokens(model, request)
        if result.status is Status.COMPLETED:
            assert result.tokens == want
        else:  # cancelled or failed: what was committed is still the model's
            assert result.tokens == want[:len(result.tokens)] and result.finish_reason in reasons
        if request.finisher is not None:
            assert result.output == ("cycle2", result.tokens, (None,) * len(result.tokens))  # asks no values
