"""A drawn step with a cut in two kernels around the sort
(``KernelConfig.cut_kernel``, ``cut_sample``).

- Anywhere: the setting is off by default, needs ``draw_kernel``, and
  says when it is on; a variant turns it on.
- With Triton, no GPU: the kernels run in Triton's interpreter and draw
  the tokens torch's cut path draws, write ``last_token`` and the flags
  where it does, and draw a row's token alone as beside others
  (``tests/cut_interpreted.py``); both build for the H200's sm_90 with an
  IEEE division, libdevice's logarithm and a logical hash, and no spills
  (``tests/test_gemm_compiles.py``, beside the other kernels' builds).
- On a GPU: the same against torch's cut path with the noise kernel's
  noise, at Qwen2's vocabulary and others; a backend with it draws
  reproducibly, within masks, and without a cut as with one
  (``tests/test_draw_kernel.py``, its backend test).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bubblefree.bench.step_ab import variant
from bubblefree.cuda_backend.kernel_config import KernelConfig
from tests.test_draw_kernel import _step

ROOT = Path(__file__).resolve().parent.parent
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a Triton kernel")


def test_cut_kernel_is_off_by_default_needs_the_draw_kernel_and_says_when_it_is_on():
    assert KernelConfig().cut_kernel is False
    assert "cut" not in str(KernelConfig())
    assert "drawn steps with a cut sampled around the sort in two kernels" in str(
        KernelConfig(cut_kernel=True))
    with pytest.raises(ValueError, match="cut_kernel needs draw_kernel"):
        KernelConfig(draw_kernel=False, cut_kernel=True)
    assert variant(KernelConfig(), "cut_kernel=1").cut_kernel is True
    with pytest.raises(ValueError, match="cut_kernel needs draw_kernel"):
        variant(KernelConfig(), "draw_kernel=0+cut_kernel=1")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs Triton (CUDA builds of torch ship it)")
def test_the_kernels_draw_what_torchs_cut_path_draws_in_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.cut_interpreted"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"cut kernels: \d+ steps, \d+ rows, as torch's cut path", done.stdout)


CUTS = (dict(top_p=0.9), dict(top_k=50), dict(min_p=0.05), dict(), dict(top_k=20, top_p=0.5))


def _clear_of_rounding(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether a row's kept set is the same under any rounding of its sums:
    in float64, no rank's mass before it within 1e-5 of ``top_p`` and no
    probability within 1e-5 of ``min_p`` times the best's (the kernels and
    torch's cut path round their sums differently, ``cut_sample``'s doc)."""
    ordered = scaled.double().sort(descending=True, stable=True).values
    ordered = ordered[:top_k] if top_k else ordered
    probs = torch.softmax(ordered, 0)
    before = torch.cumsum(probs, 0) - probs
    return bool((before - top_p).abs().min() > 1e-5 or top_p == 1.0) and bool(
        (probs / probs[0] - min_p).abs().min() > 1e-5 or min_p == 0.0)


@CUDA
@pytest.mark.parametrize("v", [64, 4097, 151936])
@pytest.mark.parametrize("n,b", [(1, 1), (3, 4), (8, 8)])
def test_the_kernels_draw_what_torchs_cut_path_draws_with_the_same_noise(v, n, b):
    from bubblefree.cuda_backend import gumbel
    from bubblefree.cuda_backend.cut_sample import make_cut_sampler
    from bubblefree.cuda_backend.sampling import Draw, sample_inputs, unpack_sampling, vocab_hash
    salt = vocab_hash(v, torch.device("cuda"))
    sampler = make_cut_sampler(v, torch.device("cuda"))
    compared = 0  # drawn rows whose token was compared
    for seed in range(3):
        logits, table, inputs, kind = _step(v, n, b, seed, CUTS[seed:] + CUTS[:seed])
        sampled = torch.full((b,), -1, dtype=torch.long, device="cuda")
        last = torch.zeros(n + 1, dtype=torch.long, device="cuda")
        flags = torch.ones(n + 1, dtype=torch.bool, device="cuda")
        sampler(logits, table, inputs, b, sampled, last, flags)
        _, want = sample_inputs(inputs, logits, table, salt, b, Draw.CUT, gumbel.noise)
        assert kind is (Draw.CUT if n > 1 else Draw.GREEDY)
        _, mask_ids, draws = unpack_sampling(inputs, b)
        for i in range(n):
            scaled = logits[i].masked_fill(~table[mask_ids[i]], float("-inf")) / max(
                float(draws.temperature[i]), 1e-5)
            if float(draws.temperature[i]) == 0 or _clear_of_rounding(
                    scaled.cpu(), int(draws.top_k[i]), float(draws.top_p[i]),
                    float(draws.min_p[i])):
                assert int(sampled[i]) == int(want[i]), (seed, i)
                compared += float(draws.temperature[i]) > 0
        assert int(sampled[0]) == v // 2  # row 0 is greedy: the tie to the lower id
        masks = inputs[b:b + n].tolist()
        assert all(bool(table[m, t]) for m, t in zip(masks, sampled[:n].tolist()))
        assert torch.equal(last[:n], sampled[:n]) and not flags[:n].any()
    assert compared >= 2 * (n - 1)  # most drawn rows are clear of rounding (row 0 is greedy)
