"""The split attention kernel run whole (``Dispatch.whole_rows``), built
for the H200's sm_90 without a GPU (Triton's own ptxas), as a launch of
Qwen2-0.5B's one-row step specializes it: what it reads after its wait."""

from __future__ import annotations

import inspect
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402

from bubblefree.cuda_backend import paged_decode_kernels as kernels  # noqa: E402
from tests.test_gemm_compiles import _ptxas, _source  # noqa: E402

pytestmark = pytest.mark.skipif(_ptxas() is None,
                                reason="needs Triton's ptxas to compile for sm_90")

POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pt_ptr": "*i32",
            "pos_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
            "cs_ptr": "*fp32", "sn_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*bf16",
            "kn_ptr": "*bf16", "vn_ptr": "*bf16", "slot_ptr": "*i64", "f_ptr": "*bf16",
            "fo_ptr": "*bf16"}
# What a launch finds divisible by 16 at Qwen2's shapes (heads of 64, rows of
# 896 and 1,152): the pointers and the strides of the query, the cache, the
# output and the step's own key and value (without it no load is vectorized).
ALIGNED = set(POINTERS) | {"sq_b", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "scs_b", "chunk",
                           "so_b", "so_h", "skn_b", "skn_h", "svn_b", "svn_h"}


def _whole_ptx(keys: int, warps: int) -> str:
    """The PTX of ``split_kernel`` with WHOLE over ``keys`` keys, launched
    dependent with its keys read before the wait, in ``warps`` warps."""
    fn = kernels.split_kernel
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: POINTERS.get(n, "fp32" if n == "scale" else "i32")
                 for n in names if n[0].islower()}
    consts = dict(GROUP=7, PS=16, D=64, BLOCK_D=64, BLOCK_N=keys, NEW=True, ROT=64, PDL=True,
                  PREFETCH=True, LAST_COMBINES=False, BLOCK_S=1, ACT=0, BLOCK_F=16, SLICES=1,
                  DT=triton.language.bfloat16, WHOLE=True)
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    source = _source(fn=fn, signature={**signature, **dict.fromkeys(consts, "constexpr")},
                     constexprs=consts, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps)).asm["ptx"]


@pytest.mark.parametrize("warps", [2, 8])
def test_one_program_a_head_reads_every_key_before_its_wait(warps):
    """Whole and prefetching, the kernel's one block is every key: the loop
    over further blocks runs no iteration and is not compiled, so what it
    loads after ``griddepcontrol.wait`` (the query, the step's own key and
    value, their rotary values) is as much at 64 keys as at 512, and its
    loads before the wait grow with the keys."""
    before, after = [], []
    for keys in (64, 512):
        ptx = _whole_ptx(keys, warps)
        wait = ptx.index("griddepcontrol.wait")
        before.append(len(re.findall(r"ld\.global", ptx[:wait])))
        after.append(len(re.findall(r"ld\.global", ptx[wait:])))
    assert after[0] == after[1] and before[1] > before[0], (before, after)
