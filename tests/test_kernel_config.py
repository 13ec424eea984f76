"""Which kernels a decode step runs is one frozen value per backend
(cuda_backend/kernel_config.py), passed down: no module of the CUDA backend
keeps a dispatch or tile table of its own, and two backends built with
different configs in one process each keep theirs."""

from __future__ import annotations

import importlib
import pkgutil

import attrs
import pytest
import torch

import bubblefree.cuda_backend
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.kernel_config import Dispatch, KernelConfig, Launch, Tile, TileTable
from bubblefree.cuda_backend.measured import MEASURED
from bubblefree.cuda_backend.tiny import tiny_model

CONFIG_TYPES = (KernelConfig, Dispatch, TileTable, Launch, Tile)


def _holds_config(value, depth: int = 0) -> bool:
    if isinstance(value, CONFIG_TYPES):
        return True
    if depth < 4 and isinstance(value, (dict, list, set, tuple)):
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        return any(_holds_config(k, depth + 1) or _holds_config(v, depth + 1) for k, v in items)
    return False


def test_no_module_keeps_a_dispatch_or_tile_table():
    """No global a benchmark or test could assign or patch: no module-level
    config value, and no mutable container holding one."""
    names = [m.name for m in pkgutil.iter_modules(bubblefree.cuda_backend.__path__)]
    assert "kernel_config" in names and "paged_decode_kernels" in names
    found = []
    for name in names:
        module = importlib.import_module(f"bubblefree.cuda_backend.{name}")
        for attr, value in vars(module).items():
            if attr in ("DISPATCH", "TILES") or _holds_config(value):
                found.append(f"{name}.{attr}")
    assert found == []


def test_the_config_and_the_measured_tables_are_frozen():
    config = KernelConfig.measured("cpu")
    for value, field in [(config, "new_token"), (config.dispatch, "split_below"),
                         (config.dispatch.plain, "warps"), (config.tiles, "entries"),
                         (Tile(), "split")]:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(value, field, 1)
    with pytest.raises(TypeError):
        MEASURED["Some GPU"] = TileTable()  # type: ignore[index]
    assert isinstance(MEASURED["NVIDIA H200"].entries, tuple)
    assert hash(config) == hash(KernelConfig.measured("cpu"))


def _backend(model, kernels=None):
    return CudaBackend(model, page_size=4, num_pages=32, max_rows=4, max_seqs=8,
                       max_prefill_tokens=64, min_graph_context=8, kernels=kernels)


def test_two_backends_in_one_process_keep_their_own_config():
    apart = KernelConfig(dispatch=Dispatch().forced(0, Launch(2, 32, 2, 1)), new_token=False,
                         mlp_act=False, tiles=TileTable({(64, 320): ((8, Tile(32, 32, 1, 4, 3)),)}))
    first = _backend(tiny_model("phi", seed=1))
    second = _backend(tiny_model("phi", seed=1), apart)
    third = _backend(tiny_model("phi", seed=1))
    assert first.kernels == third.kernels == KernelConfig.measured("cpu") != apart
    assert second.kernels is apart
    assert str(first.kernels) != str(second.kernels) == (
        "attention: one-pass 2x32w2s1; rotary and KV write separate; GEMM: ours for 64->320 at "
        "measured rows")
    for be, kernels, act in [(first, KernelConfig(), 1), (second, apart, 0),
                             (third, KernelConfig(), 1)]:
        decoder = be._runner.decoder
        assert decoder.rope_in_kernel == kernels.new_token
        assert decoder.dims.act == act and decoder.dims.tiles == kernels.tiles
        assert be._runner.decode_inputs(1, 1)[2].dispatch == kernels.dispatch
        assert be._runner.token_prefill is None or be._runner.token_prefill.dispatch == \
            kernels.dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backend_asks_for_the_defaults_measured_for_its_weights_dtype(monkeypatch, dtype):
    """The measured tiles serve 16-bit weights only (``MEASURED_DTYPES``):
    the backend names its weights' dtype when it asks for its defaults."""
    asked = []
    real = KernelConfig.measured.__func__

    def measured(cls, device, config=None, **kw):
        asked.append(kw.get("dtype"))
        return real(cls, device, config, **kw)

    monkeypatch.setattr(KernelConfig, "measured", classmethod(measured))
    be = _backend(tiny_model("llama", seed=1).to(dtype))
    assert asked == [dtype] and be.kernels == KernelConfig()
