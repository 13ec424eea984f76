"""``bench.step_ab``: a variant's tiles replace the dependent step's tiles
for the shapes it names and no others; every bad variant or argument is
named before anything is built (the steps themselves need a GPU)."""

from __future__ import annotations

import re

import attrs
import pytest
import transformers

from bubblefree.bench.step_ab import main, variant
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile
from bubblefree.cuda_backend.measured import LLAMA_32_1B

LLAMA = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                 num_key_value_heads=8, vocab_size=128256)


def h200() -> KernelConfig:
    kernels = KernelConfig.for_gpu("NVIDIA H200", LLAMA)
    assert kernels.pdl_rows == 8, LLAMA_32_1B  # the measured shape
    return kernels


def test_base_is_the_measured_defaults():
    assert variant(h200(), "base") == h200()


def test_a_variant_replaces_the_named_shapes_tiles_in_every_bucket_and_nothing_else():
    default = h200()
    got = variant(default, "2048,3072=32n256k2s4w3p+8192,2048=64n256k4s4w3p")
    assert got.pdl_tiles.tile_for(1, 2048, 3072) == Tile(32, 256, 2, 4, 3)
    assert got.pdl_tiles.tile_for(8, 2048, 3072) == Tile(32, 256, 2, 4, 3)
    assert got.pdl_tiles.tile_for(8, 8192, 2048) == Tile(64, 256, 4, 4, 3)
    assert got.pdl_tiles.tile_for(9, 2048, 3072) is None  # past the dependent step's buckets
    for shape in [(2048, 2048), (2048, 16384), (2048, 128256)]:
        assert got.pdl_tiles.tile_for(1, *shape) == default.pdl_tiles.tile_for(1, *shape)
    assert got.dispatch == default.dispatch and got.tiles == default.tiles
    assert variant(default, "4096,4096=64n128k1s4w3p").pdl_tiles.tile_for(1, 4096, 4096)


@pytest.mark.parametrize("text,says", [
    ("2048=64n256k4s4w3p", "is not K,N=TILE"),
    ("2048,3072", "is not K,N=TILE"),
    ("a,3072=64n256k4s4w3p", "is not K,N=TILE"),
    ("2048,3072=64x", "variant '2048,3072=64x': GEMM tile '64x'"),
    ("2048,3072=64n256k16s4w3p", "does not cut K=2048 into whole steps of 256"),
    ("2000,3072=64n256k1s4w3p", "does not cut K=2000"),
    ("2048,3072=32n256k2s4w3p+bad", "'bad' is not K,N=TILE"),
])
def test_a_bad_variant_is_named(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        variant(h200(), text)


def test_where_no_dependent_step_runs_a_variant_is_refused():
    with pytest.raises(ValueError, match="run no dependent-launch step"):
        variant(KernelConfig(), "2048,3072=32n256k2s4w3p")
    assert variant(KernelConfig(), "base") == KernelConfig()


@pytest.mark.parametrize("argv,says", [
    (["--rows", "3"], "--rows must be decode buckets"),
    (["--rows", "1,x"], "--rows must be comma-separated integers"),
    (["--context", "0"], "--context must be at least 1"),
    (["--variant", "base", "--increments", "2048,3072=32n256k2s4w3p"], "is not one of the --variant"),
])
def test_bad_arguments_are_named_before_anything_is_built(argv, says, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err


def test_a_variant_sets_a_row_count_and_nothing_else():
    default = h200()
    assert variant(default, "o_combines=0").o_combines == 0 != default.o_combines
    assert variant(default, "last_combines=8").last_combines == 8
    assert variant(default, "pdl_rows=0").pdl_rows == 0
    assert variant(default, "sample_ahead=0").sample_ahead == 0 != default.sample_ahead
    got = variant(default, "o_combines=2")
    assert got.o_combines == 2 and got.pdl_tiles == default.pdl_tiles
    mixed = variant(default, "o_combines=0+2048,2048=128n256k8s4w3p")
    assert mixed.o_combines == 0 and mixed.pdl_tiles.tile_for(1, 2048, 2048) == Tile(128, 256, 8, 4, 3)
    assert mixed.pdl_tiles.tile_for(1, 2048, 3072) == default.pdl_tiles.tile_for(1, 2048, 3072)
    for bad in ("o_combines=x", "o_combines=-1", "o_combines="):
        with pytest.raises(ValueError, match=re.escape(f"variant {bad!r}: o_combines is a row count")):
            variant(default, bad)


def test_a_variant_sets_the_split_kernels_launch_and_nothing_else():
    default = h200()
    got = variant(default, "split_warps=1+split_block=64+max_splits=4+whole_rows=2+whole_keys=128")
    assert (got.dispatch.split_warps, got.dispatch.split_block, got.dispatch.max_splits,
            got.dispatch.whole_rows, got.dispatch.whole_keys) == (1, 64, 4, 2, 128)
    assert attrs.evolve(got, dispatch=default.dispatch) == default
    for bad, says in [("split_warps=3", "Dispatch.split_warps must be a power of two"),
                      ("split_block=8", "Dispatch.split_block must be a power of two"),
                      ("max_splits=0", "Dispatch.max_splits must be a positive int"),
                      ("whole_keys=48", "Dispatch.whole_keys must be a power of two"),
                      ("split_warps=x", "split_warps is a count")]:
        with pytest.raises(ValueError, match=re.escape(f"variant {bad!r}: {says}")):
            variant(default, bad)


def test_a_variant_above_some_rows_keeps_the_tiles_up_to_them():
    default = h200()
    got = variant(default, "2048,2048:1=64n256k8s4w3pe")
    assert got.pdl_tiles.tile_for(1, 2048, 2048) == default.pdl_tiles.tile_for(1, 2048, 2048)
    for rows in (2, 4, 8):
        assert got.pdl_tiles.tile_for(rows, 2048, 2048) == Tile.parse("64n256k8s4w3pe")
    # rows up to R that the defaults cover with a wider entry keep its tile
    wide = variant(default, "8192,2048:4=32n256k8s4w3p")
    for rows in (1, 2, 4):
        assert wide.pdl_tiles.tile_for(rows, 8192, 2048) == default.pdl_tiles.tile_for(rows, 8192, 2048)
    assert wide.pdl_tiles.tile_for(8, 8192, 2048) == Tile(32, 256, 8, 4, 3)
    # items apply in order: every bucket first, then all but the first
    both = variant(default, "2048,2048=128n256k8s4w3p+2048,2048:1=32n256k8s4w3p")
    assert both.pdl_tiles.tile_for(1, 2048, 2048) == Tile(128, 256, 8, 4, 3)
    assert both.pdl_tiles.tile_for(2, 2048, 2048) == Tile(32, 256, 8, 4, 3)
    for bad, says in [("2048,2048:8=32n256k8s4w3p", "sets no bucket"),
                      ("2048,2048:x=32n256k8s4w3p", "is not K,N=TILE nor K,N:ROWS=TILE"),
                      ("2048,2048:=32n256k8s4w3p", "is not K,N=TILE nor K,N:ROWS=TILE")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            variant(default, bad)
