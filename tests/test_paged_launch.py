"""How a decode bucket's attention kernel is chosen, and the one-pass
kernel's launch settings as benchmarks and tuning tools name them (the
kernels themselves are tested on the GPU)."""

from __future__ import annotations

import pytest

from bubblefree.cuda_backend.paged_decode import DISPATCH, Dispatch, Launch, forced, split_chunk


@pytest.mark.parametrize("text", ["1x32w2s1", "4x32w4s3", "8x16w2s1", str(DISPATCH.plain)])
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


def test_forcing_a_launch_applies_it_everywhere_and_keeps_the_default():
    launch = Launch.parse("2x32w2s3")
    d = forced(split_below=0, launch=launch)
    assert all(d.choose(r, 32, n) == launch for r in (1, 8, 64) for n in (32, 144, 528))
    assert str(d) == "one-pass 2x32w2s3"
    assert DISPATCH == Dispatch() and forced() == DISPATCH


def test_where_the_new_token_and_the_activation_run_is_named():
    """Rotary, the KV write and Phi's activation run inside the attention
    kernels by default; a dispatch that moves them out says so."""
    assert DISPATCH.new_token and DISPATCH.mlp_act and "separate" not in str(DISPATCH)
    assert str(forced(new_token=False)).endswith("; rotary and KV write separate")
    assert str(forced(mlp_act=False)).endswith("; Phi's MLP activation separate")
    assert forced(new_token=False, split_below=0).split_below == 0  # the rest kept


def test_split_chunks_cap_the_programs_per_row_and_head():
    for length in (16, 32, 144, 2048, 2049, 32768):
        chunk = split_chunk(length)
        assert chunk >= 32 and chunk & (chunk - 1) == 0 and -(-length // chunk) <= 64
        assert chunk == 32 or -(-length // (chunk // 2)) > 64  # the least such power of two
