"""The decode GEMM (``skinny_gemm``) compiles for Hopper in each of its
forms, without a GPU. Triton's compiler checks what its interpreter does
not: when the first steps, read before the wait, were loaded under a name
the K loop then gave a narrower tile, the interpreter ran it and only the
GPU's compile failed. Skipped, with the reason, where Triton or its
bundled ptxas is absent (CPU-only builds of torch lack Triton)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="needs Triton (CUDA builds of torch ship it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bubblefree.cuda_backend import skinny_gemm  # noqa: E402


def _ptxas() -> str | None:
    """The ptxas Triton would run for sm_90, or None where it has none."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except (ImportError, RuntimeError, AttributeError):
        return None


pytestmark = pytest.mark.skipif(_ptxas() is None,
                                reason="needs Triton's ptxas to compile for sm_90")

ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32",
        "N": "i32", "steps": "i32", "sx_m": "i32", "sw_n": "i32", "so_s": "i32", "so_m": "i32",
        "up_off": "i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "heads": "i32"}


@pytest.mark.parametrize("form", ["partial", "whole", "glu"])
@pytest.mark.parametrize("ahead", [1, 2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_gemm_compiles_for_hopper(form, ahead, pdl):
    consts = dict(HAS_BIAS=True, PARTIAL=form == "partial", IEEE=False, GLU=form == "glu",
                  PDL=pdl, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, STAGES=3, AHEAD=ahead,
                  STATES=0, BLOCK_S=1, HD=1, DT=triton.language.bfloat16, ROWS=1)
    signature = {**ARGS, **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(fn=skinny_gemm._gemm_kernel, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"]


@pytest.mark.parametrize("monotonic", [False, True])
def test_the_grid_wait_benchmarks_kernel_compiles_for_hopper(monotonic):
    """``bench.grid_wait``: its waits poll with acquiring loads; the count
    that only grows takes one atomic a program a wait, the count and
    generation more (the arrival, then the last arrival's reset and move)."""
    from bubblefree.bench import grid_wait
    consts = dict(MONOTONIC=monotonic)
    signature = {"sync_ptr": "*i32", "out_ptr": "*i32", "rounds": "i32",
                 **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(fn=grid_wait._waits_kernel, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = kernel.asm["ptx"]
    assert "ld.acquire.gpu.global.b32" in ptx
    assert (ptx.count("atom.") == 1) == monotonic


@pytest.mark.parametrize("early", [False, True])
def test_the_norm_releases_the_next_kernel_before_it_waits_only_when_early(early):
    """``add_norm``'s EARLY (KernelConfig.early_norms): the dependents'
    release comes before the wait; without it, after (``pdl.enter``)."""
    from bubblefree.cuda_backend import add_norm
    consts = dict(RMS=True, HAS_B=False, PDL=True, BLOCK=1024, SPLITS=8, EARLY=early)
    signature = {"x_ptr": "*bf16", "p_ptr": "*fp32", "w_ptr": "*bf16", "b_ptr": "*bf16",
                 "xo_ptr": "*bf16", "h_ptr": "*bf16", "N": "i32", "splits": "i32",
                 "sx_m": "i32", "sp_s": "i32", "sp_m": "i32", "so_m": "i32", "eps": "fp32",
                 **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(fn=add_norm._add_norm_kernel, signature=signature, constexprs=consts)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=8)).asm["ptx"]
    release = ptx.index("griddepcontrol.launch_dependents")
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.launch_dependents") == ptx.count("griddepcontrol.wait") == 1
    assert (release < wait) == early
