"""Weights asked into L2 ahead of their GEMM (cuda_backend/l2_ahead.py):
each GEMM's window of the step's weights, the plans the kernel reads, and
on a Hopper GPU that asking changes no output. The GPU cases are skipped,
with the reason, elsewhere."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubblefree.cuda_backend import l2_ahead, pdl
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile
from bubblefree.cuda_backend.tiny import tiny_model

PDL = pytest.mark.skipif(not pdl.supported("cuda"),
                         reason="needs a GPU of compute capability 9 or later and Triton")


def _by_byte(sizes: list[int], distance: int) -> list[list[tuple[int, int]]]:
    """Each GEMM's asked bytes as (gemm, offset), one by one: the bytes
    ``distance`` past each of its own in the cyclic stream, not its own;
    ``distance`` at most what keeps the largest GEMM off its own next turn."""
    total, starts = sum(sizes), [sum(sizes[:j]) for j in range(len(sizes))]
    distance = min(distance, total - max(sizes))
    owner = [(j, o) for j, size in enumerate(sizes) for o in range(size)]
    out = []
    for a, size in zip(starts, sizes):
        out.append([owner[p % total] for p in range(a + distance, a + size + distance)
                    if a + size <= p < a + total])
    return out


@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=9),
       distance=st.integers(0, 400))
def test_each_gemm_asks_for_the_bytes_ahead_of_it_once_and_never_its_own(sizes, distance):
    windows = l2_ahead.windows(sizes, distance)
    want = _by_byte(sizes, distance)
    asked = []
    for j, (pieces, bytes_) in enumerate(zip(windows, want)):
        got = [(g, off + i) for g, off, n in pieces for i in range(n)]
        assert all(n > 0 for _, _, n in pieces) and len(pieces) <= l2_ahead.RANGES
        runs = sum(i == 0 or bytes_[i] != (bytes_[i - 1][0], bytes_[i - 1][1] + 1)
                   for i in range(len(bytes_)))
        if runs <= l2_ahead.RANGES:
            assert got == bytes_  # whole where it fits in RANGES pieces
        else:
            assert got == bytes_[:len(got)] and got  # else cut, in stream order
        assert all(g != j for g, _ in got)
        asked += got
    assert len(asked) == len(set(asked))
    if distance == 0 or len(sizes) == 1:
        assert not asked
    else:  # however far, something is asked for
        assert asked


def test_windows_name_bad_sizes():
    for sizes, distance in [([], 0), ([4, 0], 8), ([4], -1)]:
        with pytest.raises(ValueError, match="l2_ahead"):
            l2_ahead.windows(sizes, distance)


def test_a_plan_holds_addresses_and_bytes_of_the_weights_ahead():
    """Three GEMMs of 1, 2 and 3 KiB (bf16), 2 KiB ahead: each asks for the
    bytes 2 KiB past its own. The first for the second's last KiB, the
    second for the third's first 2 KiB, the third for the first's KiB and
    the second's first (the next step's)."""
    ws = [torch.zeros(n, 512, dtype=torch.bfloat16) for n in (1, 2, 3)]
    plans = l2_ahead.plans(ws, 2048)
    assert all(p.shape == (l2_ahead.RANGES, 2) and p.dtype == torch.int64 for p in plans)
    rows = [[tuple(r) for r in p.tolist() if r[1]] for p in plans]
    ptr = [w.data_ptr() for w in ws]
    assert rows[0] == [(ptr[1] + 1024, 1024)]
    assert rows[1] == [(ptr[2], 2048)]
    assert rows[2] == [(ptr[0], 1024), (ptr[1], 1024)]
    assert l2_ahead.plans(ws, 0) == [None, None, None]


def test_l2_ahead_is_mib_and_says_itself():
    assert "weights 16 MiB ahead into L2" in str(KernelConfig(pdl_rows=8, l2_ahead=16))
    assert "L2" not in str(KernelConfig(l2_ahead=16))  # no dependent step: no effect
    with pytest.raises(ValueError):
        KernelConfig(l2_ahead=-1)


def test_the_dependent_layers_carry_a_plan_per_gemm():
    """Where it is off (or there is no dependent step) each GEMM's plan is
    None; the layer weights carry one per GEMM in the order it runs."""
    from tests.test_cuda_fused import backend
    for arch, per in (("llama", 4), ("phi", 2)):
        decoder = backend(tiny_model(arch, seed=7), kernels=KernelConfig(l2_ahead=8))._runner.decoder
        assert all(len(w[-1]) == per and set(w[-1]) == {None} for w in decoder.pdl_weights)
        assert decoder.head_plan is None


# -- on the GPU -----------------------------------------------------------------------


@PDL
@pytest.mark.parametrize("tile", ["32n128k1s4w3p", "32n64k4s4w3p", "16n128k1s8w3p"])
def test_asking_l2_changes_no_output(tile):
    """The same GEMM with a plan over other tensors' weights (three ranges,
    one of a single byte past a line's start) gives the same bits; the
    asked weights are untouched."""
    from bubblefree.cuda_backend import skinny_gemm
    torch.manual_seed(0)
    t = Tile.parse(tile)
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    others = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (1 << 20, 4099, 65)]
    kept = [o.clone() for o in others]
    plan = torch.tensor([(others[0].data_ptr(), 2 << 20), (others[1].data_ptr() + 130, 8000),
                         (others[2].data_ptr(), 129), (0, 0)], dtype=torch.int64, device="cuda")
    for glu in (False, True):
        want = skinny_gemm.launch(x, w, None, t, pdl=True, glu=glu and t.split == 1)
        got = skinny_gemm.launch(x, w, None, t, pdl=True, glu=glu and t.split == 1, plan=plan,
                                 participants=7)
        assert torch.equal(got, want)
    assert all(torch.equal(o, k) for o, k in zip(others, kept))


@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
def test_the_dependent_step_asking_l2_decodes_the_same_tokens(arch):
    """In CUDA graphs, each GEMM asking for the weights ahead: the same
    greedy tokens as without."""
    from tests.test_pdl_step import PROMPTS, _small
    model = tiny_model(arch, device="cuda", seed=4)
    base = attrs.evolve(KernelConfig.measured("cuda"), pdl_rows=8)
    want = generate(_small(model, kernels=base), PROMPTS, 10)
    be = _small(model, kernels=attrs.evolve(base, l2_ahead=1))
    decoder = be._runner.decoder
    assert all(p is not None for w in decoder.pdl_weights for p in w[-1])
    assert decoder.head_plan is not None and "MiB ahead into L2" in str(be.kernels)
    assert generate(be, PROMPTS, 10) == want
