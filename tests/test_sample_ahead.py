"""Sampling ahead (``KernelConfig.sample_ahead``, ``CudaBackend``): a decode
step samples greedily in its forward, and a finalize whose rows are all
greedy, unmasked and ask no value keeps those tokens.

- Whatever the calls, a backend sampling ahead gives exactly the outputs of
  one that does not: steps of plain, masked, temperature and (moondream)
  value rows, and two steps launched at once, sharing rows or not,
  finalized in either order (the contract's input is the token *sampled*
  last for a row slot, so a launch sharing rows with a launched step must
  not see that step's tokens sampled ahead).
- A plain step launches no sampling; any other does, and so do both steps
  of a pair that shares a row.

On a GPU the backends run in CUDA graphs, where a forward's logits are a
graph's output that the next launch overwrites: the copy launch defers
must happen before that. There, too, the Llama-3.2-1B shape in the step
the GPU runs it in gives the same tokens both ways.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.core.values import SamplePlan, SamplingParams, StepKind, StepPlan, StepRow, ValueKind
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.kernel_config import SAMPLE_AHEAD, KernelConfig
from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.weights import random_model
from bubblefree.cuda_backend.tiny import tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Graphs on where there is CUDA; torch.compile off: dozens of backends are
# built, and what is sampled ahead does not depend on how the forward runs.
CAP = dict(page_size=4, num_pages=64, max_rows=3, max_seqs=6, max_prefill_tokens=24,
           max_context=48, min_graph_context=8, compile_decode=False)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a real shape's step")
SEQS = 4
PAGES = 12  # a sequence's own pages: the whole context
PROMPTS = [(5, 9, 17), (7, 8, 3, 3), (100, 3), (11, 12, 13, 14, 15)]
MASKS = (frozenset(range(0, 128, 3)), frozenset({5, 7, 64}))


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_model("llama", device=DEVICE, seed=3),
            "moondream": random_model(tiny_config(), device=DEVICE)}


def backend(model, kind: str, ahead: int):
    cls = MoondreamBackend if kind == "moondream" else CudaBackend
    kernels = attrs.evolve(KernelConfig.measured(DEVICE, getattr(model, "config", None)),
                           sample_ahead=ahead)
    return cls(model, kernels=kernels, **CAP)


@attrs.define
class Driver:
    """Drives one backend through a script of steps, counting the
    samplings its finalizes launch."""

    be: object
    lengths: list = attrs.Factory(lambda: [len(p) for p in PROMPTS])
    samplings: int = 0
    ids: int = 0

    def __attrs_post_init__(self):
        for allowed in MASKS:
            self.be.register_mask(allowed)
        run = self.be._sample_graphs.run

        def counted(key, fn):
            self.samplings += 1
            return run(key, fn)
        self.be._sample_graphs.run = counted
        rows = [StepRow(seq_id=i, row_slot=i, tokens=p, position=0, pages=self.pages(i))
                for i, p in enumerate(PROMPTS)]
        for part in (rows[:3], rows[3:]):
            plan = StepPlan(self.next_id(), StepKind.PREFILL, tuple(part))
            self.be.launch(0, plan)
            self.be.finalize(0, SamplePlan(plan.step_id, (None,) * len(part)))
            self.be.wait(0)
            self.be.release(0)

    def next_id(self) -> int:
        self.ids += 1
        return self.ids

    @staticmethod
    def pages(seq: int) -> tuple[int, ...]:
        return tuple(range(seq * PAGES, (seq + 1) * PAGES))

    def plan(self, rows):
        """A decode step of ``rows`` ((seq, how) pairs), each a position on."""
        out = []
        for seq, how in rows:
            sampling = SamplingParams(temperature=0.7, seed=seq + 1) if how == "temp" \
                else SamplingParams()
            out.append(StepRow(seq_id=seq, row_slot=seq, tokens=(), position=self.lengths[seq],
                               pages=self.pages(seq), sampling=sampling))
            self.lengths[seq] += 1
        return StepPlan(self.next_id(), StepKind.DECODE, tuple(out))

    def sample_plan(self, plan, rows):
        masks = tuple(1 + MASKS.index(MASKS[seq % 2]) if how == "mask" else None
                      for seq, how in rows)
        values = tuple({"coord": ValueKind.COORD, "size": ValueKind.SIZE}.get(how)
                       for _, how in rows)
        return SamplePlan(plan.step_id, masks, values if any(values) else ())

    def step(self, rows, slot=0):
        plan = self.plan(rows)
        self.be.launch(slot, plan)
        self.be.finalize(slot, self.sample_plan(plan, rows))
        out = self.be.wait(slot)
        self.be.release(slot)
        return [out]

    def pair(self, first, second, order):
        """``first`` launched into slot 0, ``second`` into slot 1 before
        either is finalized; finalized in ``order``."""
        plans = {0: self.plan(first), 1: self.plan(second)}
        rows = {0: first, 1: second}
        self.be.launch(0, plans[0])
        self.be.launch(1, plans[1])
        for slot in order:
            self.be.finalize(slot, self.sample_plan(plans[slot], rows[slot]))
        outs = [self.be.wait(slot) for slot in order]
        for slot in order:
            self.be.release(slot)
        return outs

    def run(self, script):
        outs = []
        for event in script:
            outs += self.step(event[1]) if event[0] == "step" else self.pair(*event[1:])
        return [(o.tokens, o.values) for o in outs]


def rows_strategy(hows):
    return st.lists(st.tuples(st.integers(0, SEQS - 1), st.sampled_from(hows)), min_size=1,
                    max_size=3, unique_by=lambda r: r[0])


def script_strategy(kind):
    hows = ["plain", "plain", "mask", "temp"] + (["coord", "size"] if kind == "moondream" else [])
    rows = rows_strategy(hows)
    return st.lists(st.one_of(
        st.tuples(st.just("step"), rows),
        st.tuples(st.just("pair"), rows, rows, st.sampled_from([(0, 1), (1, 0)]))),
        min_size=1, max_size=6)


def both(models, kind):
    return (Driver(backend(models[kind], kind, SAMPLE_AHEAD)),
            Driver(backend(models[kind], kind, 0)))


@pytest.mark.parametrize("kind", ["llama", "moondream"])
def test_the_default_samples_ahead_and_zero_does_not(models, kind):
    ahead, plain = both(models, kind)
    assert ahead.be.kernels.sample_ahead == SAMPLE_AHEAD >= CAP["max_rows"]
    assert plain.be.kernels.sample_ahead == 0
    assert "no tokens sampled ahead" in str(plain.be.kernels)


@pytest.mark.parametrize("kind", ["llama", "moondream"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_outputs_are_those_of_a_backend_that_does_not_sample_ahead(models, kind, data):
    script = data.draw(script_strategy(kind))
    ahead, plain = both(models, kind)
    assert ahead.run(script) == plain.run(script)


@pytest.mark.parametrize("kind", ["llama", "moondream"])
def test_a_plain_step_launches_no_sampling_and_any_other_does(models, kind):
    ahead, plain = both(models, kind)
    cases = [([(0, "plain"), (1, "plain")], 0), ([(2, "plain")], 0),
             ([(0, "mask"), (1, "plain")], 1), ([(3, "temp")], 1),
             ([(0, "plain"), (1, "plain"), (2, "plain")], 0)]
    if kind == "moondream":
        cases += [([(1, "coord")], 1), ([(1, "plain")], 0)]
    for rows, samples in cases:
        before = ahead.samplings
        assert ahead.step(rows)[0] == plain.step(rows)[0]
        assert ahead.samplings - before == samples, rows
    assert plain.samplings == plain.ids  # without sampling ahead, every step samples


@pytest.mark.parametrize("kind", ["llama", "moondream"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_launch_sharing_rows_with_a_launched_step_reads_the_tokens_sampled_before_it(
        models, kind, order):
    """Slot 0's step samples ahead; slot 1's, launched before slot 0 is
    finalized, shares seq 0: it must read seq 0's token sampled before slot
    0's step (on moondream, after a value row: the value's encoding, whose
    flag slot 0's sampling ahead cleared), and both steps sample."""
    ahead, plain = both(models, kind)
    first = [(0, "coord")] if kind == "moondream" else [(0, "mask")]
    assert ahead.step(first) == plain.step(first)
    before = ahead.samplings
    pair = ([(0, "plain"), (1, "plain")], [(2, "plain"), (0, "plain")], order)
    assert ahead.pair(*pair) == plain.pair(*pair)
    assert ahead.samplings - before == 2
    # And the rows go on from there alike, sampling ahead again.
    rows = [(0, "plain"), (1, "plain"), (2, "plain")]
    assert ahead.step(rows) == plain.step(rows) and ahead.samplings - before == 2


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_launch_of_other_rows_keeps_the_launched_step_s_tokens(models, order):
    """Disjoint rows: slot 0's deferred logits are copied before slot 1's
    forward (on a GPU its graph overwrites them), and slot 0's plain
    finalize keeps what it sampled ahead."""
    ahead, plain = both(models, "llama")
    before = ahead.samplings
    pair = ([(0, "plain"), (1, "plain")], [(2, "mask"), (3, "plain")], order)
    assert ahead.pair(*pair) == plain.pair(*pair)
    assert ahead.samplings - before == 1  # slot 1's mask only
    pair = ([(0, "mask")], [(2, "plain"), (3, "temp")], order)
    assert ahead.pair(*pair) == plain.pair(*pair)
    assert ahead.samplings - before == 3


def test_a_failed_launch_leaves_nothing_deferred(models, monkeypatch):
    ahead, plain = both(models, "llama")
    be = ahead.be

    def boom(*args):
        raise RuntimeError("device on fire")
    plan = ahead.plan([(0, "plain")])
    monkeypatch.setattr(be, "_decode_step", boom)
    monkeypatch.setattr(be._decode_graphs, "run", lambda key, fn: fn())
    with pytest.raises(Exception, match="device on fire"):
        be.launch(0, plan)
    assert not be._slots[0].ahead and not be._slots[0].pending
    monkeypatch.undo()
    ahead.lengths[0] -= 1  # the failed step's position again
    rows = [(0, "plain"), (1, "plain")]
    assert ahead.step(rows)[0].tokens == plain.step(rows)[0].tokens


@CUDA
def test_a_real_shape_gives_the_same_tokens_sampling_ahead_or_not():
    """Llama-3.2-1B's shape, random bf16 weights, in the step measured for
    this GPU (dependent launches where measured), compiled and in graphs:
    the kernel samples ahead from the forward's bfloat16 logits, finalize
    from their float32 copy. Greedy tokens alike, unmasked (every decode
    step keeps what it sampled ahead) and with a mask on one row (none
    does)."""
    from bubblefree.bench.speed_setup import build_model

    model, _ = build_model(False, shape="llama1b")
    prompts = [[1, 5, 9, 2] * 4, [3, 3, 3], [7] * 20, [100, 200, 300]]
    runs = []
    for ahead in (SAMPLE_AHEAD, 0):
        kernels = attrs.evolve(KernelConfig.measured("cuda", model.config), sample_ahead=ahead)
        be = CudaBackend(model, max_rows=8, max_seqs=8, num_pages=64, max_context=256,
                         kernels=kernels)
        mask = be.register_mask(frozenset(range(0, be.vocab_size, 3)))
        runs.append((generate(be, prompts, 24), generate(be, prompts, 24, page_seed=1,
                                                          mask_ids=[None, mask, None, None])))
        del be
    assert runs[0] == runs[1]
    assert all(t % 3 == 0 for t in runs[0][1][1])
