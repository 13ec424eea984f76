"""A (row, head) of decode attention in one program (``Dispatch.whole_rows``,
``paged_decode.whole_attention``): where the dispatch sends a bucket, the
setting's bounds and errors on the CPU; on CUDA, the kernel against the
portable op (output, cache, activation), keys read before the wait or
after, and the whole step's tokens with it and without."""

from __future__ import annotations

import attrs
import pytest
import torch

from bubblefree.cuda_backend import pdl
from bubblefree.cuda_backend.kernel_config import Dispatch, KernelConfig
from tests.attention_case import rope_case

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Triton kernels")
PDL = pytest.mark.skipif(not pdl.supported("cuda"),
                         reason="dependent launches need a Hopper or later GPU")


def test_a_bucket_runs_whole_up_to_its_rows_and_keys():
    dispatch = Dispatch(whole_rows=2, whole_keys=256)
    assert dispatch.whole(1, 256) and dispatch.whole(2, 32)
    assert not dispatch.whole(3, 32) and not dispatch.whole(1, 257)
    assert not Dispatch().whole(1, 32)  # off by default: 0 rows


def test_the_setting_says_itself_only_where_it_is_on():
    assert "one program" not in str(Dispatch())
    assert str(Dispatch(whole_rows=1)).endswith(
        "; a (row, head) in one program up to one row and 256 keys")
    assert str(Dispatch(whole_rows=4, whole_keys=128)).endswith(
        "; a (row, head) in one program up to 4 rows and 128 keys")


@pytest.mark.parametrize("bad", [-1, 1.0, True, "1", None])
def test_whole_rows_is_a_row_count(bad):
    with pytest.raises(ValueError, match="Dispatch.whole_rows is a row count"):
        Dispatch(whole_rows=bad)


@pytest.mark.parametrize("bad", [0, 8, 48, 1024, 256.0, False, "256"])
def test_whole_keys_is_a_power_of_two_in_its_range(bad):
    with pytest.raises(ValueError, match="Dispatch.whole_keys must be a power of two from 16 "
                                         "to 512"):
        Dispatch(whole_keys=bad)


@CUDA
@pytest.mark.parametrize("launch", [False, pytest.param(True, marks=PDL)])
@pytest.mark.parametrize("kv_heads,window,dtype,pages,rot", [
    (4, None, torch.float32, 8, 64), (1, None, torch.float32, 8, 32), (2, 5, torch.float32, 8, 64),
    (4, None, torch.bfloat16, 8, 32), (4, None, torch.float32, 2, 64),
    (2, 40, torch.float32, 32, 32), (2, None, torch.bfloat16, 16, 64),
    (4, 1, torch.float32, 8, 64)])
def test_one_program_a_head_matches_the_portable_op(kv_heads, window, dtype, pages, rot, launch):
    """Rotary, the KV write and attention as the torch path computes them,
    the cache written alike, with the keys read after the wait and (launched
    dependent) before it, in buckets of 32 to 512 keys (2 to 32 pages of
    16): 512 keys are 8 warps' registers."""
    from bubblefree.cuda_backend import paged_decode as pd
    from bubblefree.cuda_backend.rope_attention import _portable
    torch.manual_seed(kv_heads * 7 + rot + pages)
    caches, table, positions, slot, q, k, v, cos, sin, win = rope_case(kv_heads, window, dtype,
                                                                       pages, rot)
    want = _portable(q, k, v, cos, sin, caches[1].layer_kv(0), slot, table, positions, 16,
                     0.125, win).float()
    kv = caches[0].layer_kv(0)
    out = torch.empty_like(q)
    pd.whole_attention(q, kv[0], kv[1], table, positions, 16, 0.125, win, out,
                       pd.NewToken(k, v, cos, sin, slot), pdl=launch, prefetch=launch)
    err = ((out.float() - want).norm() / want.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    torch.testing.assert_close(caches[0].data, caches[1].data)


@CUDA
@pytest.mark.parametrize("act,dtype,inter", [(1, torch.bfloat16, 8192), (2, torch.float32, 37)])
def test_the_mlp_activation_rides_on_one_program_a_head(act, dtype, inter):
    """Phi's ``[attention | act(fc1)]``: the activation shared among a row's
    programs, as the split kernel's combining pass shares it."""
    from bubblefree.cuda_backend import paged_decode as pd
    from bubblefree.cuda_backend.rope_attention import _torch_act
    torch.manual_seed(inter)
    caches, table, positions, slot, q, k, v, cos, sin, win = rope_case(2, None, dtype, 8, 64)
    mlp = (torch.randn(6, inter + 3, device="cuda", dtype=dtype) * 3)[:, 3:]
    row = torch.empty(6, 4 * 64 + inter, device="cuda", dtype=dtype)
    kv = caches[0].layer_kv(0)
    pd.whole_attention(q, kv[0], kv[1], table, positions, 16, 0.125, win,
                       row[:, :256].view(6, 4, 64), pd.NewToken(k, v, cos, sin, slot),
                       pd.Activation(mlp, row[:, 256:], act))
    kv = caches[1].layer_kv(0)
    split = pd.split_attention(q, kv[0], kv[1], table, positions, 16, 0.125, win,
                               new=pd.NewToken(k, v, cos, sin, slot))
    torch.testing.assert_close(row[:, :256].view(6, 4, 64), split)
    torch.testing.assert_close(row[:, 256:], _torch_act(mlp, act).to(dtype))


@CUDA
@pytest.mark.parametrize("rows,pages,whole", [(1, 16, True), (2, 16, True), (3, 16, False),
                                              (1, 32, False)])
def test_the_dispatch_sends_a_bucket_whole_within_its_bounds(rows, pages, whole, monkeypatch):
    """``run`` runs a split bucket whole up to ``whole_rows`` rows and
    ``whole_keys`` keys (here 2 and 256: 16 pages of 16), else the split
    kernel; same output either way."""
    from bubblefree.cuda_backend import paged_decode as pd
    torch.manual_seed(rows * pages)
    caches, table, positions, slot, q, k, v, cos, sin, win = rope_case(2, None, torch.float32,
                                                                       pages, 64, rows)
    called = []
    real = pd.whole_attention
    monkeypatch.setattr(pd, "whole_attention", lambda *a, **kw: called.append(1) or real(*a, **kw))
    outs = []
    for dispatch in (Dispatch(whole_rows=2, whole_keys=256), Dispatch()):
        kv = caches[len(outs)].layer_kv(0)
        outs.append(pd.run(q, kv[0], kv[1], table, positions, 16, 0.125, win, dispatch,
                           new=pd.NewToken(k, v, cos, sin, slot)))
    assert len(called) == int(whole)
    torch.testing.assert_close(outs[0], outs[1])


@CUDA
@PDL
@pytest.mark.parametrize("arch", ["phi", "llama", "qwen2"])
def test_the_dependent_step_with_a_head_in_one_program_decodes_the_same_tokens(arch):
    """Every bucket of the dependent step's split kernel run whole (one
    prompt alone, then four in a bucket of 4) or split: same tokens."""
    from bubblefree.cuda_backend.drive import generate
    from bubblefree.cuda_backend.tiny import tiny_model
    from tests.test_pdl_step import PROMPTS, _small
    model = tiny_model(arch, device="cuda", seed=4)
    base = KernelConfig.measured("cuda")
    runs = []
    for rows in (0, 8):
        dispatch = attrs.evolve(base.dispatch, split_below=1 << 30, whole_rows=rows)
        be = _small(model, kernels=attrs.evolve(base, pdl_rows=8, dispatch=dispatch))
        assert ("a (row, head) in one program" in str(be.kernels)) == bool(rows)
        runs.append(generate(be, PROMPTS, 10))
    assert runs[0] == runs[1]
