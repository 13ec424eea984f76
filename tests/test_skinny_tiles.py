"""Which GEMM a decode step's projection runs: our decode-sized kernel
where the backend's ``TileTable`` has a tile for the weight's shape and row
count, cuBLAS (``F.linear``) everywhere else (the kernel itself is tested on
the GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bubblefree.cuda_backend import skinny_gemm as sg
from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile, TileTable, tile_for
from bubblefree.cuda_backend.measured import MEASURED


def test_a_tile_reads_back_as_written_and_names_bad_input():
    assert str(Tile.parse("64n128k4s4w3p")) == "64n128k4s4w3p"
    assert Tile.parse("64n128k4s4w3p").ahead == 1  # one step read before the wait unless said
    assert Tile.parse("32n256k19s8w2p4a") == Tile(32, 256, 19, 8, 2, 4)
    assert str(Tile(32, 256, 19, 8, 2, 4)) == "32n256k19s8w2p4a"
    assert Tile.parse("16n128k1s4w1pv") == Tile(16, 128, 1, 4, 1, 1, vector=1)
    assert Tile.parse(" 64n256k19s4w1p2av ") == Tile(64, 256, 19, 4, 1, 2, vector=1)
    assert str(Tile(16, 128, 1, 4, 1, vector=1)) == "16n128k1s4w1pv"
    assert not Tile.parse("64n128k4s4w3p").vector
    assert Tile.parse("16n128k1s4w1pve") == Tile(16, 128, 1, 4, 1, 1, vector=1, early=1)
    assert str(Tile(16, 128, 1, 4, 1, vector=1, early=1)) == "16n128k1s4w1pve"
    assert not Tile.parse("16n128k1s4w1pv").early
    assert Tile.parse("64n128k4s4w3p2ae") == Tile(64, 128, 4, 4, 3, 2, early=1)
    assert str(Tile(64, 128, 4, 4, 3, early=1)) == "64n128k4s4w3pe"
    for bad in ("16n128k1s4w1pvee", "16n128k1s4w1pev", "e"):
        with pytest.raises(ValueError, match="expected") as err:
            Tile.parse(bad)
        assert repr(bad) in str(err.value)
    for bad, says in [("64n128k4s4w3pvv", "expected"), ("48n128k4s4w3pv", "block_n must be"),
                      ("v", "expected"), ("64n128k4s4w3p3av", "ahead must be a power"),
                      ("64n128k4s", "expected"), ("48n128k4s4w3p", "block_n must be a power"),
                      ("64n128k4s4w3pa", "expected"), ("64n128k4s4w3p3a", "ahead must be a power"),
                      ("64n8k1s4w3p", "block_k >= 16"), ("64n128k0s4w3p", "split >= 1")]:
        with pytest.raises(ValueError, match=says) as err:
            Tile.parse(bad)
        assert repr(bad) in str(err.value)


def test_a_tile_fits_k_in_whole_steps_with_ahead_of_them_in_every_slice():
    t = Tile.parse("64n128k4s4w3p")
    assert t.fits(2048) and t.fits(512) and not t.fits(256) and not t.fits(2048 + 64)
    assert t.fits(2048 + 128)  # 17 steps: slices of 4, 4, 4 and 5
    ahead = Tile.parse("32n128k3s4w3p2a")  # each slice reads two steps before the wait
    assert ahead.fits(896) and not ahead.fits(640) and not ahead.fits(896 + 64)
    assert Tile.parse("32n256k19s4w3p").fits(4864) and not Tile.parse("32n256k20s4w3p").fits(4864)


def test_the_vector_form_refuses_more_rows_than_it_unrolls_32_bit_weights_and_big_shares():
    from bubblefree.cuda_backend import skinny_gemv
    x, w = torch.zeros(skinny_gemv.MAX_ROWS + 1, 128), torch.zeros(16, 128)
    with pytest.raises(ValueError, match="16n128k1s4w1pv takes at most 8 rows, not 9"):
        sg.launch(x, w, None, Tile.parse("16n128k1s4w1pv"))
    with pytest.raises(ValueError, match="16n128k1s4w1pv takes 16-bit weights, not torch.float32"):
        sg.launch(x[:1], w, None, Tile.parse("16n128k1s4w1pv"))
    x, w2 = torch.zeros(1, 4864, dtype=torch.bfloat16), torch.zeros(2 * 896, 4864, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="would hold 8192 weights a thread .*gate and up"):
        sg.launch(x, w2, None, Tile.parse("64n256k1s4w1pv"), glu=True)


def test_the_table_picks_by_rows_and_falls_back_to_cublas():
    table = TileTable.read({"2048,14336": [[64, None], [1, "64n128k1s4w3p"],
                                           [32, "64n256k2s4w5p"]]})
    assert table.tile_for(1, 2048, 14336) == Tile(64, 128, 1, 4, 3)
    assert table.tile_for(8, 2048, 14336) == Tile(64, 256, 2, 4, 5)
    assert table.tile_for(32, 2048, 14336) == Tile(64, 256, 2, 4, 5)
    assert table.tile_for(48, 2048, 14336) is None  # measured: cuBLAS won at 64 rows
    assert table.tile_for(65, 2048, 14336) is None and table.tile_for(1, 2048, 2048) is None
    # What the GEMM op is handed: rows and the tile's fields per entry, zeros for cuBLAS.
    assert table.scalars(2048, 14336) == [1, 64, 128, 1, 4, 3, 1, 0, 0, 32, 64, 256, 2, 4, 5, 1,
                                          0, 0, 64, 0, 0, 0, 0, 0, 0, 0, 0]
    vector = TileTable.read({"896,9728": [[8, "16n128k1s4w1pv"]]})
    assert tile_for(vector.scalars(896, 9728), 4) == Tile(16, 128, 1, 4, 1, vector=1)
    early = TileTable.read({"896,9728": [[8, "16n128k1s4w1pve"]]})
    assert tile_for(early.scalars(896, 9728), 4) == Tile(16, 128, 1, 4, 1, vector=1, early=1)
    ahead = TileTable.read({"896,896": [[8, "32n64k5s4w3p2a"]]})
    assert ahead.tile_for(8, 896, 896) == Tile(32, 64, 5, 4, 3, 2)
    assert ahead.scalars(896, 896) == [8, 32, 64, 5, 4, 3, 2, 0, 0]
    assert table.scalars(2048, 2048) == [] and table.shapes() == [(2048, 14336)]


def test_on_the_cpu_every_projection_is_f_linear():
    table = TileTable({(8, 5): ((64, Tile(32, 8, 1, 4, 3)),)})
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(sg.linear(x, w, b, table), F.linear(x, w, b))
    assert torch.equal(sg._skinny_linear(x, w, None, table.scalars(8, 5)), F.linear(x, w))


def test_every_measured_tile_serves_its_shape():
    """Entries ascend by rows, and each tile divides its K into whole steps
    (a tile that did not would fall back to cuBLAS unseen)."""
    for gpu, table in MEASURED.items():
        for (k, n), entries in table.entries:
            rows = [m for m, _ in entries]
            assert rows == sorted(set(rows)), (gpu, k, n)
            assert all(t is None or t.fits(k) for _, t in entries), (gpu, k, n)


def test_a_gpu_that_was_not_measured_runs_cublas(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Other GPU")
    other = KernelConfig.measured("cuda")
    assert other.tiles == TileTable() and other.tiles.tile_for(32, 10240, 2048) is None
    assert str(other.tiles) == "cuBLAS"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    h200 = KernelConfig.measured("cuda")
    assert h200.tiles == MEASURED["NVIDIA H200"] and h200.tiles.tile_for(32, 10240, 2048)
    assert h200 == KernelConfig(tiles=MEASURED["NVIDIA H200"])  # the rest: the defaults
    assert KernelConfig.measured("cpu") == KernelConfig()
