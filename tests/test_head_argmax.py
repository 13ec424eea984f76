"""The head GEMM sampling ahead itself (``KernelConfig.head_argmax``,
``greedy_sample.HeadArgmax``, ``skinny_gemm``'s ARGMAX): each program folds
its rows' best logit into one word a row, and the last program writes the
tokens where the greedy kernel's sampling ahead writes them.

- Anywhere: the setting is a row count that says itself, off by default;
  a step that cannot take it (no dependent launches) says so, and refuses
  an ``argmax`` handed to it rather than drop it.
- On a GPU: the GEMM's tokens, ``sampled``, ``undo``, ``last_token`` and
  the flags equal ``torch_ahead``'s from the same logits, bit for bit, ties
  at the best logit to the lowest id, in either slot, launch after launch
  (the words and the count reset themselves), launched plainly and
  dependent, in a graph after the kernel that writes its input.
  Backends with it decode what backends without it decode
  (tests/test_sample_ahead.py, the real shapes below).
"""

from __future__ import annotations

import attrs
import pytest
import torch

from bubblefree.bench.step_ab import variant
from bubblefree.cuda_backend import pdl, skinny_gemm
from bubblefree.cuda_backend.graphs import GraphSet
from bubblefree.cuda_backend.greedy_sample import HeadArgmax, make_sampler, torch_ahead
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile
from bubblefree.cuda_backend.tiny import tiny_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a Triton kernel")
PDL = pytest.mark.skipif(not torch.cuda.is_available() or not pdl.supported("cuda"),
                         reason="needs a GPU with dependent launches (Hopper)")


def test_head_argmax_is_a_row_count_off_by_default_that_says_itself():
    assert KernelConfig().head_argmax == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="head_argmax"):
            KernelConfig(head_argmax=bad)
    on = KernelConfig(pdl_rows=8, head_argmax=4)
    assert "the head sampling ahead itself up to 4 rows" in str(on)
    assert "head sampling" not in str(KernelConfig(pdl_rows=8))
    assert "head sampling" not in str(attrs.evolve(on, sample_ahead=0))  # nothing to sample
    assert variant(KernelConfig(pdl_rows=8), "head_argmax=8").head_argmax == 8


def test_a_step_that_cannot_take_it_says_so_and_refuses_one_handed_to_it():
    """Without dependent launches (none asked for; on a CPU none can run)
    no bucket's head samples ahead, whatever ``head_argmax`` says; an
    ``argmax`` handed to the step anyway is refused by name, not
    dropped (its tokens would never be written)."""
    from bubblefree.cuda_backend.backend import CudaBackend
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("llama", device=device, seed=3)
    be = CudaBackend(model, max_rows=4, max_seqs=4, num_pages=16, max_context=64,
                     kernels=KernelConfig(pdl_rows=0, head_argmax=8))
    r = be._runner
    assert not any(r.head_samples(b) for b in (1, 2, 4))
    n = 4
    argmax = HeadArgmax(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                        torch.zeros(2, n, dtype=torch.long), torch.zeros(2, 2 * n, dtype=torch.long),
                        r.last_token, None, torch.zeros(n, dtype=torch.long),
                        torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="head_samples"):
        r.decode_forward(1, 1, argmax=argmax)


def _case(v: int, b: int, k: int, dtype, seed: int):
    """x ``[b, k]`` and a head ``[v, k]`` of small integers, so that every
    logit is exact in any order of summing: row 0's best is tied between
    two columns far apart (the lower id must win), row 1's between columns
    2 and 3, and the other rows' logits tie often."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (b, k), generator=g).float()
    w = torch.randint(-3, 4, (v, k), generator=g).float()
    lo, hi = v // 3, v - 1
    w[lo] = w[hi] = torch.sign(x[0]) * 4  # row 0's best, in two columns far apart
    if b > 1:
        w[2] = w[3] = torch.sign(x[1]) * 4  # row 1's
    return x.to(dtype).cuda(), w.to(dtype).cuda()


def _targets(b: int, seqs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    row_slots = torch.randperm(seqs, generator=g)[:b].cuda()
    last = torch.randint(0, 99, (seqs,), generator=g).cuda()
    flags = (torch.rand(seqs, generator=g) > 0.5).cuda()
    sampled = torch.full((2, 8), -1, dtype=torch.long, device="cuda")
    undo = torch.full((2, 16), -1, dtype=torch.long, device="cuda")
    return row_slots, sampled, undo, last, flags


@CUDA
@pytest.mark.parametrize("v,k", [(64, 256), (1000, 256), (151936, 896)])
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tile", ["64n128k1s4w3p", "32n128k1s4w3p2ae", "16n64k1s4w2p"])
@pytest.mark.parametrize("launch_pdl", [False, pytest.param(True, marks=PDL)])
def test_the_gemm_writes_what_sampling_ahead_writes_from_its_logits(v, k, b, dtype, tile,
                                                                    launch_pdl):
    x, w = _case(v, b, k, dtype, seed=v + b)
    t = Tile.parse(tile)
    sampler = make_sampler(8, v, torch.device("cuda"))
    for at in (1, 0, 1):  # either slot, again: the words and the count reset themselves
        row_slots, sampled, undo, last, flags = _targets(b, 12, seed=at + b)
        want = [t_.clone() for t_ in (sampled, undo, last, flags)]
        at_slot = torch.tensor([at], device="cuda")
        argmax = sampler.in_head(row_slots, at_slot, sampled, undo, last, flags)
        logits = skinny_gemm.run(x, w, None, t, pdl=launch_pdl, argmax=argmax)
        torch_ahead(logits, row_slots, at_slot, *want)
        for got, ref in zip((sampled, undo, last, flags), want):
            assert torch.equal(got, ref), (at, got, ref)
        assert int(sampled[at, 0]) == v // 3  # the ties went to the lower ids
        assert b == 1 or int(sampled[at, 1]) == 2
    assert int(sampler.heads_done) == 0
    assert (sampler.keys == torch.iinfo(torch.int64).min).all()


@CUDA
def test_a_gemm_that_cannot_take_it_refuses_it():
    x, w = _case(1000, 2, 256, torch.bfloat16, seed=1)
    sampler = make_sampler(8, 1000, torch.device("cuda"))
    row_slots, sampled, undo, last, flags = _targets(2, 12, seed=1)
    argmax = sampler.in_head(row_slots, torch.tensor([0], device="cuda"), sampled, undo, last,
                             flags)
    for tile in ("64n128k2s4w3p", "16n64k1s4w1pv"):  # sums of K's slices; the vector form
        with pytest.raises(ValueError, match="sampling ahead"):
            skinny_gemm.run(x, w, None, Tile.parse(tile), argmax=argmax)
    with pytest.raises(ValueError, match="sampling ahead"):  # a row slot short
        skinny_gemm.run(x[:1].repeat(3, 1), w, None, Tile.parse("64n128k1s4w3p"), argmax=argmax)


@PDL
@pytest.mark.parametrize("b", [1, 3])
def test_in_a_graph_after_the_kernel_that_writes_its_input(b):
    """In the step's order: a dependent norm writes the head's input, and
    the head, launched dependent on it, reads what it keeps to undo before
    its wait. Replayed on new inputs, with ``last_token`` and the flags
    changed between replays, it writes what the torch path writes from
    its own logits."""
    from bubblefree.cuda_backend.add_norm import add_norm
    v, k, seqs = 151936, 896, 12
    x, w = _case(v, b, k, torch.bfloat16, seed=b)
    norm_w = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    parts = torch.zeros(1, b, k, device="cuda")
    row_slots, sampled, undo, last, flags = _targets(b, seqs, seed=b)
    at = torch.tensor([1], device="cuda")
    sampler = make_sampler(8, v, torch.device("cuda"))
    argmax = sampler.in_head(row_slots, at, sampled, undo, last, flags)
    out = {}

    def step():
        normed = add_norm(x, parts, norm_w, None, 1e-6, True, pdl=True)[1]
        out["logits"] = skinny_gemm.run(normed, w, None, Tile.parse("64n128k1s4w3p"), pdl=True,
                                        argmax=argmax)

    graphs = GraphSet(torch.device("cuda"), True)
    graphs.capture("step", step)
    g = torch.Generator().manual_seed(b)
    for i in range(4):
        x.copy_(torch.randn(b, k, generator=g))
        last.copy_(torch.randint(0, 99, (seqs,), generator=g))
        flags.copy_(torch.rand(seqs, generator=g) > 0.5)
        want = [t.clone() for t in (sampled, undo, last, flags)]
        graphs.run("step", step)
        torch_ahead(out["logits"], row_slots, at, *want)
        for got, ref in zip((sampled, undo, last, flags), want):
            assert torch.equal(got, ref), i
    assert int(sampler.heads_done) == 0


@PDL
@pytest.mark.parametrize("shape", ["qwen05b", "llama1b"])
def test_a_real_shape_decodes_the_same_tokens_with_the_head_sampling_or_not(shape):
    """Qwen2-0.5B's and Llama-3.2-1B's shapes, random bf16 weights, in the
    step measured for this GPU, compiled and in graphs: greedy tokens alike
    with the head sampling ahead, with the kernel after it, and with none
    sampled ahead; unmasked (every decode step keeps what was sampled
    ahead) and with a mask on one row (none does)."""
    from bubblefree.bench.speed_setup import build_model
    from bubblefree.cuda_backend.backend import CudaBackend
    from bubblefree.cuda_backend.drive import generate

    model, _ = build_model(False, shape=shape)
    prompts = [[1, 5, 9, 2] * 4, [3, 3, 3], [7] * 20, [100, 200, 300]]
    measured = KernelConfig.measured("cuda", model.config)
    runs = []
    for fields in (dict(head_argmax=8), dict(head_argmax=0), dict(sample_ahead=0)):
        be = CudaBackend(model, max_rows=8, max_seqs=8, num_pages=64, max_context=256,
                         kernels=attrs.evolve(measured, **fields))
        assert be._runner.head_samples(1) == bool(fields.get("head_argmax"))
        mask = be.register_mask(frozenset(range(0, be.vocab_size, 3)))
        runs.append((generate(be, prompts, 24), generate(be, prompts, 24, page_seed=1,
                                                          mask_ids=[None, mask, None, None])))
        del be
    assert runs[0] == runs[1] == runs[2]
    assert all(t % 3 == 0 for t in runs[0][1][1])
