"""The decode GEMM (``skinny_gemm``) compiles for Hopper in each of its
forms, without a GPU. Triton's compiler checks what its interpreter does
not: when the first steps, read before the wait, were loaded under a name
the K loop then gave a narrower tile, the interpreter ran it and only the
GPU's compile failed. Skipped, with the reason, where Triton is absent
(CPU-only builds of torch lack it)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="needs Triton (CUDA builds of torch ship it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bubblefree.cuda_backend import skinny_gemm  # noqa: E402

ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "M": "i32",
        "N": "i32", "steps": "i32", "sx_m": "i32", "sw_n": "i32", "so_s": "i32", "so_m": "i32",
        "up_off": "i32"}


@pytest.mark.parametrize("form", ["partial", "whole", "glu"])
@pytest.mark.parametrize("ahead", [1, 2, 4])
@pytest.mark.parametrize("pdl", [False, True])
def test_the_gemm_compiles_for_hopper(form, ahead, pdl):
    consts = dict(HAS_BIAS=True, PARTIAL=form == "partial", IEEE=False, GLU=form == "glu",
                  PDL=pdl, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, STAGES=3, AHEAD=ahead)
    signature = {**ARGS, **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(fn=skinny_gemm._gemm_kernel, signature=signature, constexprs=consts)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as err:  # no ptxas here: what the front end checks has passed
        if "ptxas" not in str(err).lower():
            raise
        pytest.skip(f"the front end compiled it; no ptxas to finish: {err}")
    assert "ttgir" in kernel.asm
