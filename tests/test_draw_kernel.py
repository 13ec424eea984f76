"""Drawn steps' noise in Triton (``KernelConfig.draw_kernel``, ``gumbel``):
a step whose drawn rows have no cut samples in ``greedy_sample``'s one
kernel, and one with a cut adds ``gumbel.noise`` to torch's sort.

- Anywhere: the setting is on by default and says when it is off.
- On a GPU: ``gumbel.noise`` is torch's ``-log(-log(u))`` of the same
  hash (to the logarithms' last bits: a different hash would differ
  everywhere); the one kernel draws exactly the tokens torch's no-cut and
  cut paths draw with that noise, greedy rows and masks included, at
  Qwen2's vocabulary and others; a backend with it (and without) draws
  reproducibly, within masks, and the same tokens without a cut as with
  a cut that drops nothing.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from bubblefree.bench.step_ab import variant
from bubblefree.core.values import SamplingParams, StepRow
from bubblefree.cuda_backend import gumbel
from bubblefree.cuda_backend.greedy_sample import make_sampler
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.sampling import (PARTS, Draw, gumbel_noise, pack_sampling,
                                              sample_inputs, unpack_sampling, vocab_hash)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a Triton kernel")


def test_draw_kernel_is_on_by_default_and_says_when_it_is_off():
    assert KernelConfig().draw_kernel is True
    assert "drawn steps' noise in torch" in str(KernelConfig(draw_kernel=False))
    assert "drawn" not in str(KernelConfig())
    assert variant(KernelConfig(), "draw_kernel=0").draw_kernel is False
    assert variant(KernelConfig(), "draw_kernel=1").draw_kernel is True
    with pytest.raises(ValueError, match="draw_kernel is 0 or 1, not '64'"):
        variant(KernelConfig(), "draw_kernel=64")


def _step(v: int, n: int, b: int, seed: int, cuts: tuple[dict, ...] = ({},)):
    """Logits ``[b + 1, V]`` on the GPU (a best tied between two ids in row
    0, greedy), a mask table, and ``pack_sampling``'s inputs for ``n``
    rows in bucket ``b``: greedy and drawn rows, at low and high
    temperatures, masked and not, 64-bit seeds, ``cuts``' sampling
    fields in turn (``tests/test_cut_sample.py`` takes it too)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b + 1, v, generator=g) * 3
    logits[0, v // 2] = logits[0, v - 1] = 50.0
    table = torch.rand(3, v, generator=g) > 0.4
    table[0] = True
    temps = [0.0, 0.7, 1.3, 1e-5, 30.0]
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(), position=31 * i + seed, pages=(),
                         sampling=SamplingParams(temperature=temps[i % 5],
                                                 seed=(2**63 + 7919 * i + seed) % 2**64,
                                                 **cuts[i % len(cuts)]))
                 for i in range(n))
    a = np.zeros(PARTS * b, dtype=np.int64)
    kind = pack_sampling(a, rows, tuple([None, 1, 2][i % 3] for i in range(n)), b, scratch_row=n)
    return logits.cuda(), table.cuda(), torch.from_numpy(a).cuda(), kind


@CUDA
@pytest.mark.parametrize("v", [64, 4097, 151936])
def test_the_noise_kernel_is_torchs_noise_of_the_same_hash(v):
    _, _, inputs, _ = _step(v, 5, 8, seed=v)
    _, _, draws = unpack_sampling(inputs, 8)
    salt = vocab_hash(v, torch.device("cuda"))
    got, want = gumbel.noise(draws, salt), gumbel_noise(draws, salt)
    assert got.shape == want.shape == (8, v)
    # A hash that differed anywhere would differ by whole units there.
    torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)


@CUDA
@pytest.mark.parametrize("v", [64, 4097, 151936])
@pytest.mark.parametrize("n,b", [(1, 1), (3, 4), (8, 8)])
def test_one_kernel_draws_what_torch_draws_with_the_same_noise(v, n, b):
    for seed in range(3):
        logits, table, inputs, kind = _step(v, n, b, seed)
        salt = vocab_hash(v, torch.device("cuda"))
        sampler = make_sampler(8, v, torch.device("cuda"))
        sampled = torch.full((8,), -1, dtype=torch.long, device="cuda")
        last = torch.zeros(n + 1, dtype=torch.long, device="cuda")
        sampler(logits, table, inputs, b, sampled, last, None, drawn=True)
        _, plain = sample_inputs(inputs, logits, table, salt, b, Draw.PLAIN, gumbel.noise)
        _, _, wide, cut_kind = _step(v, n, b, seed, cuts=(dict(top_k=v),))  # a cut that drops nothing
        _, cut = sample_inputs(wide, logits, table, salt, b, Draw.CUT, gumbel.noise)
        assert kind is (Draw.PLAIN if n > 1 else Draw.GREEDY) and cut_kind is (
            Draw.CUT if n > 1 else Draw.GREEDY)
        assert sampled[:n].tolist() == plain[:n].tolist() == cut[:n].tolist(), seed
        assert int(sampled[0]) == v // 2  # row 0 is greedy: the tie to the lower id
        masks = inputs[b:b + n].tolist()
        assert all(bool(table[m, t]) for m, t in zip(masks, sampled[:n].tolist()))
        assert torch.equal(last[:n], sampled[:n])
    assert int(sampler.arrived.sum()) == 0


@CUDA
@pytest.mark.parametrize("kernels", [dict(draw_kernel=False), dict(draw_kernel=True),
                                     dict(draw_kernel=True, cut_kernel=True)])
def test_a_backend_with_it_draws_reproducibly_within_masks_and_without_a_cut_as_with_one(kernels):
    """Also with ``cut_kernel`` (``tests/test_cut_sample.py``): its steps
    with a cut, the nucleus's moved to other row slots and pages too."""
    from bubblefree.cuda_backend.backend import CudaBackend
    from bubblefree.cuda_backend.drive import generate
    from bubblefree.cuda_backend.tiny import tiny_model
    model = tiny_model("llama", device="cuda", seed=4)
    be = CudaBackend(model, page_size=4, num_pages=64, max_rows=4, max_seqs=8,
                     max_prefill_tokens=64, min_graph_context=8,
                     kernels=attrs.evolve(KernelConfig.measured("cuda"), **kernels))
    allowed = frozenset(range(40, 60))
    mask = be.register_mask(allowed)
    prompts = [[5, 6, 7], [8, 9], [10]]
    plain = [SamplingParams(temperature=1.3, seed=s) for s in (4, 5, 6)]
    wide = [attrs.evolve(p, top_k=be.vocab_size) for p in plain]
    nucleus = [attrs.evolve(p, top_p=0.8) for p in plain]
    got = [generate(be, prompts, 8, sampling=s, mask_ids=[None, mask, None])
           for s in (plain, wide, nucleus)]
    assert got[0] == got[1]  # the kernel's draw without a cut, the sort's with one
    for i in (0, 2):
        assert got[i] == generate(be, prompts, 8, sampling=(plain, wide, nucleus)[i],
                                  mask_ids=[None, mask, None], page_seed=9, row_slots=[7, 5, 0])
    assert all(t in allowed for t in got[0][1]) and all(t in allowed for t in got[2][1])
    assert got[2] != got[0]  # the nucleus cut changed draws
