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


MLP_ARGS = {**{p: "*bf16" for p in ("x_ptr", "a_ptr", "wo_ptr", "bo_ptr", "nw_ptr", "wgu_ptr",
                                    "bgu_ptr", "wd_ptr", "bd_ptr", "h1_ptr", "act_ptr")},
            "out_ptr": "*fp32", "sync_ptr": "*i32", "M": "i32", "N": "i32", "KO": "i32", "I": "i32",
            "eps": "fp32", **dict.fromkeys(("sx", "sa", "swo", "sh", "swgu", "sact", "swd", "so"), "i32")}


def _mlp_ptx(phase, pdl, ieee, load_poll=False) -> str:
    from bubblefree.cuda_backend import layer_mlp
    consts = dict(PHASE=phase, HAS_BO=False, HAS_BGU=True, HAS_BD=False, PDL=pdl, BM=16, BN_O=16,
                  BN_G=64, BN_D=16, BK_O=512, BK_G=128, BK_D=512, STAGES=3, IEEE=ieee,
                  LOAD_POLL=load_poll)
    args = {k: ("*fp32" if ieee and v == "*bf16" else v) for k, v in MLP_ARGS.items()}
    signature = {**args, **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(fn=layer_mlp._mlp_kernel, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert kernel.asm["cubin"]
    return kernel.asm["ptx"]


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("ieee", [False, True])
def test_the_layers_persistent_kernel_compiles_for_hopper(phase, pdl, ieee):
    """``layer_mlp``: each phase alone and the three with the grid-wide
    waits, at Qwen2-0.5B's tile widths over 132 programs. The waits'
    reads must stay atomic loads (the interpreter cannot check them)."""
    ptx = _mlp_ptx(phase, pdl, ieee)
    waits = ptx.count("ld.global.gpu.acquire")
    assert waits == (2 if phase == 3 else 0)  # one spinning read a wait
    assert ("griddepcontrol.wait" in ptx) == pdl


def test_the_persistent_kernels_waits_can_poll_with_acquiring_loads():
    """``LOAD_POLL``: each wait spins on an acquiring load of our own
    (the compiler folds the read before the loop into it), not Triton's."""
    ptx = _mlp_ptx(3, True, False, load_poll=True)
    assert ptx.count("ld.acquire.gpu.global.b32") == 2
    assert ptx.count("ld.global.gpu.acquire") == 0
