"""How a decode bucket's attention kernel is chosen, and the one-pass
kernel's launch settings as benchmarks and tuning tools name them (the
kernels themselves are tested on the GPU)."""

from __future__ import annotations

import pytest

from bubblefree.cuda_backend.kernel_config import Dispatch, KernelConfig, Launch, split_chunk


@pytest.mark.parametrize("text", ["1x32w2s1", "4x32w4s3", "8x16w2s1", str(Dispatch().plain)])
def test_a_launch_reads_back_as_written(text):
    assert str(Launch.parse(text)) == text


@pytest.mark.parametrize("text,names", [
    ("4x32w4", "HEADSxBLOCKwWARPSsSTAGES"), ("3x32w4s1", "heads must be a power of two"),
    ("4x24w4s1", "block_n must be a power of two"), ("4x32w0s1", "warps must be a power of two"),
    ("4x32w4s0", "stages must be at least 1"), ("", "expected")])
def test_a_bad_launch_is_named(text, names):
    with pytest.raises(ValueError, match=names) as err:
        Launch.parse(text)
    assert repr(text) in str(err.value)


def test_the_dispatch_follows_its_measurements():
    """Split below 512 (row, head) programs when a bucket has more than one
    chunk of keys; one-pass above, pipelined below 2,048 programs."""
    d = Dispatch()
    assert d.choose(rows=8, heads=32, length=144) is None  # 256 programs
    assert d.choose(rows=1, heads=32, length=32) == d.pipelined  # one chunk: nothing to split
    assert d.choose(rows=32, heads=32, length=144) == d.pipelined  # 1,024 programs
    assert d.choose(rows=32, heads=32, length=528) == d.pipelined
    assert d.choose(rows=64, heads=32, length=144) == d.plain
    assert d.choose(rows=64, heads=32, length=528) == d.plain
    assert d.plain.warps == d.pipelined.warps == 1 and d.pipelined.stages > d.plain.stages == 1


def test_forcing_a_launch_applies_it_everywhere_and_keeps_the_rest():
    launch = Launch.parse("2x32w2s3")
    d = Dispatch().forced(split_below=0, launch=launch)
    assert all(d.choose(r, 32, n) == launch for r in (1, 8, 64) for n in (32, 144, 528))
    assert str(d) == "one-pass 2x32w2s3"
    assert Dispatch().forced() == Dispatch()
    kept = Dispatch().forced(split_below=0)
    assert kept.split_below == 0 and kept.pipelined == Dispatch().pipelined != kept.plain


def test_where_the_new_token_and_the_activation_run_is_named():
    """Rotary, the KV write and Phi's activation run inside the attention
    kernels by default; a config that moves them out says so."""
    default = KernelConfig()
    assert default.new_token and default.mlp_act and "separate" not in str(default)
    assert str(default) == f"attention: {Dispatch()}; GEMM: cuBLAS"
    assert str(KernelConfig(new_token=False)) == (f"attention: {Dispatch()}; rotary and KV "
                                                  "write separate; GEMM: cuBLAS")
    assert str(KernelConfig(mlp_act=False)) == (f"attention: {Dispatch()}; Phi's MLP "
                                                "activation separate; GEMM: cuBLAS")


@pytest.mark.parametrize("dispatch", [Dispatch(), Dispatch().forced(0, Launch(4, 32, 2, 3)),
                                      Dispatch(7, 9, Launch(2, 64, 4, 1), Launch(8, 16, 1, 2)),
                                      Dispatch(prefetch=False, max_splits=16),
                                      Dispatch(split_block=64, split_warps=1),
                                      Dispatch(whole_rows=2, whole_keys=128)])
def test_the_ops_read_back_the_dispatch_they_are_given(dispatch):
    """The custom ops take the dispatch as integers; every field survives."""
    scalars = dispatch.scalars()
    assert all(type(x) is int for x in scalars)
    assert Dispatch.from_scalars(scalars) == dispatch
    with pytest.raises(ValueError, match="16 integers, not 15"):
        Dispatch.from_scalars(scalars[:15])


@pytest.mark.parametrize("cap", [64, 16, 5, 1])
def test_split_chunks_cap_the_programs_per_row_and_head(cap):
    for length in (16, 32, 144, 1024, 2048, 2049, 32768):
        chunk = split_chunk(length, cap)
        assert chunk >= 32 and chunk & (chunk - 1) == 0 and -(-length // chunk) <= cap
        assert chunk == 32 or -(-length // (chunk // 2)) > cap  # the least such power of two
        assert Dispatch(max_splits=cap).chunk(length) == chunk
    assert split_chunk(1024) == 32 and split_chunk(1024, 16) == 64


def test_a_split_cap_other_than_the_default_says_itself():
    assert "split programs" not in str(Dispatch())
    assert str(Dispatch(max_splits=16)).endswith("; at most 16 split programs per (row, head)")


def test_the_split_kernels_launch_says_itself_where_it_is_not_the_default():
    assert "keys an iteration" not in str(Dispatch(split_block=32, split_warps=2))
    assert str(Dispatch(split_block=64, split_warps=1)).endswith(
        "; the split kernel 64 keys an iteration, 1 warp")


@pytest.mark.parametrize("field,bad", [("split_block", 8), ("split_block", 48),
                                       ("split_block", 512), ("split_block", 32.0),
                                       ("split_warps", 0), ("split_warps", 3),
                                       ("split_warps", 16), ("split_warps", True),
                                       ("split_warps", "2"), ("split_block", None)])
def test_the_split_kernels_launch_is_a_power_of_two_in_its_range(field, bad):
    with pytest.raises(ValueError, match=f"Dispatch.{field} must be a power of two"):
        Dispatch(**{field: bad})


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "16", None])
def test_a_split_cap_that_is_not_a_positive_int_is_refused(bad):
    with pytest.raises(ValueError, match="max_splits"):
        Dispatch(max_splits=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        with pytest.raises(ValueError, match="max_splits must be at least 1"):
            split_chunk(64, bad)
