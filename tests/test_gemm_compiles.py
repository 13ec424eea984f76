"""The decode GEMM (``skinny_gemm``) compiles for Hopper in each of its
forms, without a GPU. Triton's compiler checks what its interpreter does
not: when the first steps, read before the wait, were loaded under a name
the K loop then gave a narrower tile, the interpreter ran it and only the
GPU's compile failed. The test extra installs Triton, so ``make test``
runs them on any machine; skipped, with the reason, where Triton or its
bundled ptxas is absent (CPU-only builds of torch lack Triton)."""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs Triton (CUDA builds of torch ship it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bubblefree.cuda_backend import skinny_gemm  # noqa: E402


def _source(fn, signature: dict, constexprs: dict, attrs: dict | None = None) -> ASTSource:
    """``ASTSource`` with every argument of ``fn`` typed: a constexpr the
    caller leaves out takes its default (Triton 3.9 types an argument the
    signature does not name as nothing, and fails to build)."""
    params = inspect.signature(fn.fn).parameters
    defaults = {n: p.default for n, p in params.items()
                if p.default is not inspect.Parameter.empty and n not in signature}
    constexprs = {**defaults, **constexprs}
    signature = {**signature, **dict.fromkeys(defaults, "constexpr")}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


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
@pytest.mark.parametrize("pdl,early", [(False, False), (True, False), (True, True)])
def test_the_gemm_compiles_for_hopper(form, ahead, pdl, early):
    """Each form compiles; launched dependent, the first steps' weights are
    asked for before ``griddepcontrol.wait``, and the next kernel's release
    comes after the wait, or with a tile's ``e`` (EARLY) before any load."""
    consts = dict(HAS_BIAS=True, PARTIAL=form == "partial", IEEE=False, GLU=form == "glu",
                  PDL=pdl, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, STAGES=3, AHEAD=ahead,
                  STATES=0, BLOCK_S=1, HD=1, DT=triton.language.bfloat16, ROWS=1, EARLY=early)
    signature = {**ARGS, **dict.fromkeys(consts, "constexpr")}
    source = _source(fn=skinny_gemm._gemm_kernel, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"]
    ptx = kernel.asm["ptx"]
    if pdl:
        wait, release = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
        assert ptx.index("ld.global") < wait
        assert (release < ptx.index("ld.global")) == early and (release < wait) == early


def test_a_drawn_step_compiles_with_ieee_division_cudas_logf_and_an_unsigned_hash():
    """``greedy_sample``'s kernel drawing (``KernelConfig.draw_kernel``) and
    ``gumbel``'s noise kernel, for sm_90: the scaled logit an IEEE division
    (``div.rn``, as torch's; Triton's ``/`` would approximate), the
    logarithms libdevice's (no ``lg2.approx``), the hash's shifts logical
    (``shr.u32``: an arithmetic shift would fold the sign in)."""
    from bubblefree.cuda_backend import greedy_sample, gumbel
    args = {"logits_ptr": "*fp32", "table_ptr": "*u8", "slots_ptr": "*i64", "masks_ptr": "*i64",
            "out_ptr": "*i64", "at_slot_ptr": "*i64", "undo_ptr": "*i64", "last_ptr": "*i64",
            "flag_ptr": "*u8", "best_ptr": "*fp32", "at_ptr": "*i32", "cnt_ptr": "*i32",
            "V": "i32", "sl_m": "i32", "st_m": "i32", "out_m": "i32", "chunks": "i32",
            "draws_ptr": "*i64", "bw": "i32"}
    consts = dict(BLOCK=4096, CHUNKS=64, FLAG=False, MASKED=True, AHEAD=False, PDL=False,
                  DRAW=True)
    source = _source(fn=greedy_sample._greedy_kernel,
                       signature={**args, **dict.fromkeys(consts, "constexpr")}, constexprs=consts)
    drawn = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4)).asm["ptx"]
    noise_args = {"seed_lo_ptr": "*i64", "seed_hi_ptr": "*i64", "pos_ptr": "*i64",
                  "out_ptr": "*fp32", "V": "i32", "so_m": "i32", "BLOCK": "constexpr"}
    source = _source(fn=gumbel._noise_kernel, signature=noise_args, constexprs={"BLOCK": 4096})
    noise = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4)).asm["ptx"]
    assert "div.rn.f32" in drawn and "div.full" not in drawn and "div.approx" not in drawn
    for ptx in (drawn, noise):
        assert "lg2.approx" not in ptx and "shr.s32" not in ptx and "shr.u32" in ptx


def _ptxas_says(ptx: str) -> str:
    """What ptxas ``-v`` says of ``ptx`` built for sm_90a: its registers and spills."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        said = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", str(path), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    assert said.returncode == 0, said.stderr
    return said.stdout + said.stderr


def test_the_cut_kernels_build_for_hopper_with_ieee_division_cudas_logf_and_no_spills():
    """``cut_sample`` (``KernelConfig.cut_kernel``), for sm_90: the scaled
    logit and each probability an IEEE division (``div.rn``, as torch's),
    the noise's logarithms libdevice's (no ``lg2.approx``), the hash's
    shifts logical, and nothing spilled (a walk's block in registers)."""
    from bubblefree.cuda_backend import cut_sample as c
    built = []
    for fn, args, consts, warps in (
            (c._scale_kernel, {"logits_ptr": "*fp32", "table_ptr": "*u8", "inputs_ptr": "*i64",
                               "out_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                               "V": "i32", "sl_m": "i32", "st_m": "i32", "bw": "i32"},
             dict(BLOCK=c.SCALE_BLOCK, CHUNKS=64), 4),
            (c._cut_kernel, {"ordered_ptr": "*fp32", "order_ptr": "*i64", "max_ptr": "*fp32",
                             "sum_ptr": "*fp32", "inputs_ptr": "*i64", "out_ptr": "*i64",
                             "last_ptr": "*i64", "flag_ptr": "*u8", "V": "i32", "chunks": "i32",
                             "bw": "i32"},
             dict(BLOCK=c.BLOCK, CHUNKS=64, NEGLIGIBLE=c.NEGLIGIBLE, NOISE_MAX=c.NOISE_MAX,
                  NO_RANK=c.NO_RANK, FLAG=True), c.WARPS)):
        source = _source(fn=fn, signature={**args, **dict.fromkeys(consts, "constexpr")},
                         constexprs=consts)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=warps)).asm["ptx"]
        built.append(ptx)
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        assert "lg2.approx" not in ptx and "shr.s32" not in ptx
        said = _ptxas_says(ptx)
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", said), said
    assert "shr.u32" in built[1]


@pytest.mark.parametrize("monotonic", [False, True])
def test_the_grid_wait_benchmarks_kernel_compiles_for_hopper(monotonic):
    """``bench.grid_wait``: its waits poll with acquiring loads; the count
    that only grows takes one atomic a program a wait, the count and
    generation more (the arrival, then the last arrival's reset and move)."""
    from bubblefree.bench import grid_wait
    consts = dict(MONOTONIC=monotonic)
    signature = {"sync_ptr": "*i32", "out_ptr": "*i32", "rounds": "i32",
                 **dict.fromkeys(consts, "constexpr")}
    source = _source(fn=grid_wait._waits_kernel, signature=signature, constexprs=consts)
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
    source = _source(fn=add_norm._add_norm_kernel, signature=signature, constexprs=consts)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=8)).asm["ptx"]
    release = ptx.index("griddepcontrol.launch_dependents")
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.launch_dependents") == ptx.count("griddepcontrol.wait") == 1
    assert (release < wait) == early


# What a Hopper multiprocessor gives one program (227 KB): Triton refuses to
# launch a kernel that asks more (OutOfResources).
HOPPER_SHARED = 232448


def _measured_launches():
    """Every measured tile as the step launches it: (what, K, tile, rows,
    form, dependent). In the dependent step a gate and up tile writes
    silu(gate) * up, one of several slices writes sums, any other whole
    outputs; elsewhere (``MEASURED``) sums or whole outputs."""
    from bubblefree.bench.speed_setup import SHAPES
    from bubblefree.cuda_backend.measured import MEASURED, MEASURED_PDL, model_shape
    out = []
    for gpu, table in MEASURED.items():
        for (k, n), entries in table.entries:
            out += [(f"{gpu} {k}->{n}", k, t, rows, "partial" if t.split > 1 else "whole", False)
                    for rows, t in entries if t is not None]
    for name, spec in SHAPES.items():
        config = spec["config"]()
        glu = (config.hidden_size, 2 * config.intermediate_size)
        for gpu, shapes in MEASURED_PDL.items():
            tiles = shapes[model_shape(config)][1]
            for (k, n), entries in tiles.entries:
                form = "glu" if (k, n) == glu and config.model_type != "phi" else (
                    "partial" if any(t.split > 1 for _, t in entries) else "whole")
                out += [(f"{gpu} {name} {k}->{n}", k, t, rows, form, True) for rows, t in entries]
    return out


def test_every_measured_tile_fits_a_hopper_multiprocessor_in_bf16():
    """The tiles measured on the H200 (bf16 weights, ``MEASURED_DTYPES``),
    each compiled for sm_90 as the step launches it: the shared memory it
    asks fits one multiprocessor. (In float32 some would not, Llama's q, k,
    v tile and the 64-row one of Phi's dense and fc2 among them: why the
    measured defaults serve 16-bit weights only.)"""
    launches = _measured_launches()
    assert {form for *_, form, _ in launches} == {"partial", "whole", "glu"}
    args = {**ARGS, "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16"}
    for what, _, t, rows, form, pdl in launches:
        if t.vector:
            continue  # no MMA, no shared memory: test_every_measured_vector_tile_compiles
        consts = dict(HAS_BIAS=True, PARTIAL=form == "partial", IEEE=False, GLU=form == "glu",
                      PDL=pdl, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=t.block_n,
                      BLOCK_K=t.block_k, STAGES=t.stages, AHEAD=t.ahead if pdl else 1,
                      STATES=0, BLOCK_S=1, HD=1, DT=triton.language.bfloat16, ROWS=1)
        signature = {**args, **dict.fromkeys(consts, "constexpr")}
        source = _source(fn=skinny_gemm._gemm_kernel, signature=signature, constexprs=consts)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=t.warps))
        assert kernel.metadata.shared <= HOPPER_SHARED, (what, str(t), rows, form,
                                                         kernel.metadata.shared)


GEMV_ARGS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32",
             "N": "i32", "steps": "i32", "sx_m": "i32", "sw_n": "i32", "so_s": "i32",
             "so_m": "i32", "up_off": "i32"}


def _gemv(consts: dict, warps: int):
    """``skinny_gemv``'s kernel compiled for sm_90 with ``consts``, its
    pointers and strides divisible by 16 as a launch specializes them
    (without it no load is vectorized)."""
    from bubblefree.cuda_backend import skinny_gemv
    names = list(GEMV_ARGS)
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in GEMV_ARGS if a != "steps"}
    signature = {**GEMV_ARGS, **dict.fromkeys(consts, "constexpr")}
    source = _source(fn=skinny_gemv._gemv_kernel, signature=signature, constexprs=consts,
                     attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


@pytest.mark.parametrize("form", ["partial", "whole", "glu"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("early", [False, True])
def test_the_vector_form_asks_for_all_its_weights_before_the_wait(form, rows, early):
    """``skinny_gemv`` (a tile's ``v``), launched dependent: every load of
    weights and bias is issued before ``griddepcontrol.wait``, 16 bytes at
    a time, and only x's after it; no shared memory beyond the sum's
    scratch. The next kernel's release comes after the wait, or with
    ``ve`` (EARLY) before the first load."""
    kernel = _gemv(dict(HAS_BIAS=True, PARTIAL=form == "partial", GLU=form == "glu", PDL=True,
                        BLOCK_N=16, BLOCK_K=128, SLICE=1024, ROWS=rows, EARLY=early), warps=4)
    ptx = kernel.asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    release = ptx.index("griddepcontrol.launch_dependents")
    assert ptx.count("griddepcontrol.launch_dependents") == ptx.count("griddepcontrol.wait") == 1
    assert (release < ptx.index("ld.global")) == early and (release < wait) == early
    before, after = ptx[:wait], ptx[wait:]
    # 16 columns by 1,024 of K in 128 threads: 128 values a thread in 16 loads of 16
    # bytes, twice for gate and up; then the bias (and up's).
    weights = 16 * (2 if form == "glu" else 1)
    assert before.count("ld.global.v4.b32") >= weights
    assert "ld.global.b16" not in ptx
    assert after.count("ld.global") == rows  # x: a row's 8 values a thread in one load
    assert kernel.metadata.shared <= 4096


def test_every_measured_vector_tile_compiles_and_holds_its_share():
    """The measured tiles of the vector form (``v``, ``ve``), each compiled for
    sm_90 as the step launches it at its rows, K as the shape gives it: the share
    each thread holds passes ``skinny_gemv.check``, and the kernel needs no
    shared memory beyond its sum's scratch."""
    from bubblefree.cuda_backend import skinny_gemv
    launches = [launch for launch in _measured_launches() if launch[2].vector]
    assert launches, "the measured defaults name a tile of the vector form"
    for what, k, t, rows, form, pdl in launches:
        width = skinny_gemv.slice_width(k // t.block_k, t.split, t.block_k)
        skinny_gemv.check(t, rows, torch.bfloat16, width, form == "glu")
        kernel = _gemv(dict(HAS_BIAS=True, PARTIAL=form == "partial", GLU=form == "glu", PDL=pdl,
                            BLOCK_N=t.block_n, BLOCK_K=t.block_k, SLICE=width, ROWS=rows,
                            EARLY=bool(t.early) and pdl), warps=t.warps)
        assert kernel.metadata.shared <= 4096, (what, str(t), rows, kernel.metadata.shared)


@pytest.mark.parametrize("pdl", [False, True])
def test_the_step_inputs_kernel_releases_the_first_layer_as_it_starts(pdl):
    """``step_inputs``' kernel, where the layers after it are launched
    dependent: the release is its first instruction of the kind, before any
    load, and it never waits (it is a graph's first kernel)."""
    from bubblefree.cuda_backend import step_inputs
    consts = dict(VALUES=True, BLOCK_D=1024, BLOCK_R=64, PDL=pdl)
    signature = {"rows_ptr": "*i64", "pos_ptr": "*i64", "pt_ptr": "*i64", "last_ptr": "*i64",
                 "emb_ptr": "*bf16", "flag_ptr": "*u8", "val_ptr": "*bf16", "cos_t_ptr": "*bf16",
                 "sin_t_ptr": "*bf16", "x_ptr": "*bf16", "slot_ptr": "*i64", "cos_ptr": "*bf16",
                 "sin_ptr": "*bf16", "D": "i32", "R": "i32", "P": "i32", "PS": "i32",
                 "se_v": "i32", "sv_s": "i32", "sx_b": "i32", "sct_p": "i32", "sc_b": "i32",
                 **dict.fromkeys(consts, "constexpr")}
    source = _source(fn=step_inputs._inputs_kernel, signature=signature, constexprs=consts)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4)).asm["ptx"]
    assert "griddepcontrol.wait" not in ptx
    assert ptx.count("griddepcontrol.launch_dependents") == int(pdl)
    if pdl:
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("ld.global")


@pytest.mark.parametrize("flag", [False, True])
def test_greedy_sampling_ahead_reads_its_slots_before_the_wait(flag):
    """``greedy_sample``'s kernel sampling ahead, launched dependent on the
    head: the row's slot, the step's slot and what ``last_token`` (and the
    flag) hold there are loaded before ``griddepcontrol.wait``; the logits,
    every store and the arrival after it."""
    from bubblefree.cuda_backend import greedy_sample
    consts = dict(BLOCK=greedy_sample.BLOCK, CHUNKS=64, FLAG=flag, MASKED=False, AHEAD=True,
                  PDL=True)
    signature = {"logits_ptr": "*bf16", "table_ptr": "*bf16", "slots_ptr": "*i64",
                 "masks_ptr": "*i64", "out_ptr": "*i64", "at_slot_ptr": "*i64",
                 "undo_ptr": "*i64", "last_ptr": "*i64", "flag_ptr": "*u8", "best_ptr": "*fp32",
                 "at_ptr": "*i32", "cnt_ptr": "*i32", "V": "i32", "sl_m": "i32", "st_m": "i32",
                 "out_m": "i32", "chunks": "i32", "draws_ptr": "*i64", "bw": "i32",
                 **dict.fromkeys(consts, "constexpr")}
    source = _source(fn=greedy_sample._greedy_kernel, signature=signature, constexprs=consts)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4)).asm["ptx"]
    wait = ptx.index("griddepcontrol.wait")
    before, after = ptx[:wait], ptx[wait:]
    # slot, the step's slot, last_token there (the flag: one byte)
    assert before.count("ld.global.b64") == 3 and ("ld.global.b8" in before) == flag
    assert "ld.global.b16" not in before and "st.global" not in before and "atom" not in before
    assert "ld.global" in after and "st.global" in after and "atom" in after
