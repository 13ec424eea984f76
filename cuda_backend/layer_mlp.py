"""A Llama or Qwen2 layer's second half as one persistent kernel (Triton,
CUDA): the output projection and the residual add, the second RMSNorm,
gate and up as ``silu(gate) * up``, and the down projection, for a decode
step of a few rows.

At one row each of these is a kernel of 2-8 µs whose cost is its start,
its first reads and its tail, not its bytes (docs/performance.md, "What
each kernel adds"). Here one program per multiprocessor runs three phases
one after another, each phase's columns cut evenly over the programs:

    A   h1 = x + o(a)              o's columns, K whole; h1 in x's dtype
    B   act = silu(gate) * up      of RMSNorm(h1), each program norming
                                   the whole rows it reads (a few KB)
    C   sums = down(act)           float32 ``[1, M, N]``, the bias in

with a grid-wide wait between them (an arrival counter and a generation,
``_grid_wait``), and each program asks for its next phase's first weights
before it waits, so memory keeps streaming through the waits. ``sums``
is what the output projections of ``pdl_step`` leave: the next layer's
``add_norm`` adds it to h1.

Rounding is the per-kernel step's: o rounded to x's dtype before the
residual add (as ``add_norm`` rounds a projection's sums), the norm as
``add_norm.rms_norm``, the GLU as ``skinny_gemm``'s. Sums run in another
order (K whole, not slices), so results agree with that step to float32
rounding, not bit for bit.

Every program must be resident at once for the waits to end: the grid is
at most the GPU's multiprocessors (one program each), and the next kernel
is let launch only after the last wait (``gdc_launch_dependents``), so a
dependent kernel can never take a multiprocessor a program of this one
still needs. (A GPU shared under MPS with an active thread percentage
below 100 gives a process fewer multiprocessors than it reports: keep
``KernelConfig.mlp_rows`` at 0 there.) The step's kernels run on one
stream, so no two launches share the counters at once.

Triton's interpreter runs programs one after another, so the grid-wide
wait cannot be checked there: ``launch(..., persistent=False)`` runs each
phase as a kernel of its own (three launches make the same result, and
the tests check each against torch), and the persistent kernel runs under
the interpreter with one program, where its waits pass at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.add_norm import rms_norm
from bubblefree.cuda_backend.pdl import launch_options, tl, triton

PHASES = 3  # A, B, C; PHASE == PHASES runs all three with the waits
# A step of K is about this many weights of a program's columns: a phase of
# few columns a program (o and down: 7 of Qwen2's 896 over 132) reads its
# K in wider steps, so that each program keeps as many bytes in flight as
# gate and up's 64 columns do in steps of 128.
STEP_WEIGHTS = 8192


if triton is not None:

    @triton.jit
    def _load_acquire(ptr):
        """``*ptr`` read with acquire semantics at GPU scope: a load, not a
        read-modify-write, so the waiting programs do not queue at the
        counter's cache line ahead of the arrivals."""
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _grid_wait(sync_ptr, programs, LOAD_POLL: tl.constexpr):
        """Return once every program of the grid has called this. ``sync``
        is ``[count, generation]``: the last to arrive sets the count back
        to zero (each launch leaves it so) and moves the generation on; the
        others wait for that, polling with atomics or (``LOAD_POLL``)
        acquiring loads. A program reads the generation before it arrives,
        so the last arrival cannot move it unseen."""
        gen = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
        arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == programs - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
        elif LOAD_POLL:
            seen = _load_acquire(sync_ptr + 1)
            while seen == gen:
                seen = _load_acquire(sync_ptr + 1)
        else:
            seen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
            while seen == gen:
                seen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")

    @triton.jit
    def _dot(a, w, IEEE: tl.constexpr):
        """``a @ w^T`` in float32; float32 inputs at full precision (as
        ``skinny_gemm`` and cuBLAS give them), not TensorFloat-32."""
        if IEEE:
            out = tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            out = tl.dot(a, tl.trans(w))
        return out

    @triton.jit
    def _columns(p, programs, n, BN: tl.constexpr):
        """This program's columns of ``n`` (as even as they divide) and
        whether each of its BN lanes holds one."""
        c0 = p * n // programs
        rn = c0 + tl.arange(0, BN)
        return rn, rn < (p + 1) * n // programs

    @triton.jit
    def _times_w(first, a_ptr, w_ptr, b_ptr, M, K, sa, sw, rn, n_ok, HAS_B: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
        """``a @ w^T + b`` in float32 at w's rows ``rn``, K whole; ``first``, w's
        first BK of K at those rows, was read before any wait. a is read
        past L1: another program wrote it."""
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        a0 = tl.load(a_ptr + rm[:, None] * sa + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                     other=0.0, cache_modifier=".cg")
        acc = _dot(a0, first, IEEE)
        for k in tl.range(BK, K, BK, num_stages=STAGES):
            k_ok = (k + rk) < K
            a = tl.load(a_ptr + rm[:, None] * sa + (k + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + rn[:, None] * sw + (k + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc += _dot(a, w, IEEE)
        if HAS_B:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _o_phase(first, x_ptr, a_ptr, w_ptr, b_ptr, h1_ptr, M, N, K, sx, sa, sw, sh, rn, n_ok,
                 HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, IEEE: tl.constexpr):
        """A: ``h1 = x + round(a @ w^T + b)`` at this program's columns."""
        acc = _times_w(first, a_ptr, w_ptr, b_ptr, M, K, sa, sw, rn, n_ok, HAS_B, BM, BK, STAGES, IEEE)
        rm = tl.arange(0, BM)
        mask = (rm < M)[:, None] & n_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * sx + rn[None, :], mask=mask, other=0.0)
        o = acc.to(x.dtype).to(tl.float32)
        tl.store(h1_ptr + rm[:, None] * sh + rn[None, :], (x.to(tl.float32) + o).to(x.dtype), mask=mask)

    @triton.jit
    def _normed(h1_ptr, nw_ptr, k, M, N, sh, scale, BM: tl.constexpr, BK: tl.constexpr):
        """Columns ``k ..`` (BK of them) of RMSNorm(h1), rounded as
        ``add_norm`` rounds it: normed in float32, rounded, times the
        weight, rounded."""
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        k_ok = (k + rk) < N
        v = tl.load(h1_ptr + rm[:, None] * sh + (k + rk)[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                    other=0.0, cache_modifier=".cg")
        nw = tl.load(nw_ptr + k + rk, mask=k_ok, other=0.0).to(tl.float32)
        h = (v.to(tl.float32) * scale[:, None]).to(v.dtype).to(tl.float32) * nw[None, :]
        return h.to(v.dtype)

    @triton.jit
    def _glu_phase(first_g, first_u, h1_ptr, nw_ptr, w_ptr, b_ptr, act_ptr, M, N, I, eps, sh, sw, sa,
                   rn, n_ok, HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
        """B: ``silu(gate) * up`` of RMSNorm(h1) at this program's columns
        (gate rows ``rn`` of w, up rows ``I + rn``); h1's rows are read
        through once for their scale, then normed a step of K at a time
        (``_normed``). ``first_g``, ``first_u``: the first step's weights,
        read before the wait."""
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        squares = tl.zeros([BM], dtype=tl.float32)
        for k in tl.range(0, N, BK):
            v = tl.load(h1_ptr + rm[:, None] * sh + (k + rk)[None, :],
                        mask=m_ok[:, None] & ((k + rk) < N)[None, :], other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            squares += tl.sum(v * v, axis=1)
        scale = tl.math.rsqrt(squares / N + eps)
        h = _normed(h1_ptr, nw_ptr, 0, M, N, sh, scale, BM, BK)
        acc_g = _dot(h, first_g, IEEE)
        acc_u = _dot(h, first_u, IEEE)
        for k in tl.range(BK, N, BK, num_stages=STAGES):
            k_ok = (k + rk) < N
            h = _normed(h1_ptr, nw_ptr, k, M, N, sh, scale, BM, BK)
            g = tl.load(w_ptr + rn[:, None] * sw + (k + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            u = tl.load(w_ptr + (I + rn)[:, None] * sw + (k + rk)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g += _dot(h, g, IEEE)
            acc_u += _dot(h, u, IEEE)
        if HAS_B:
            acc_g += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_ptr + I + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        dtype = act_ptr.dtype.element_ty
        g = acc_g.to(dtype).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = a * acc_u.to(dtype).to(tl.float32)
        tl.store(act_ptr + rm[:, None] * sa + rn[None, :], out.to(dtype),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_phase(first, act_ptr, w_ptr, b_ptr, out_ptr, M, N, I, sa, sw, so, rn, n_ok,
                    HAS_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    STAGES: tl.constexpr, IEEE: tl.constexpr):
        """C: ``act @ w^T + b`` in float32 at this program's columns."""
        acc = _times_w(first, act_ptr, w_ptr, b_ptr, M, I, sa, sw, rn, n_ok, HAS_B, BM, BK, STAGES, IEEE)
        rm = tl.arange(0, BM)
        tl.store(out_ptr + rm[:, None] * so + rn[None, :], acc, mask=(rm < M)[:, None] & n_ok[None, :])

    @triton.jit
    def _first(w_ptr, rn, n_ok, K, sw, BK: tl.constexpr):
        """w's first BK of K at rows ``rn``: weights, which no kernel of the
        step writes, so they may be read before any wait."""
        rk = tl.arange(0, BK)
        return tl.load(w_ptr + rn[:, None] * sw + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                       other=0.0)

    @triton.jit
    def _mlp_kernel(x_ptr, a_ptr, wo_ptr, bo_ptr, nw_ptr, wgu_ptr, bgu_ptr, wd_ptr, bd_ptr,
                    h1_ptr, act_ptr, out_ptr, sync_ptr, M, N, KO, I, eps,
                    sx, sa, swo, sh, swgu, sact, swd, so,
                    PHASE: tl.constexpr, HAS_BO: tl.constexpr, HAS_BGU: tl.constexpr,
                    HAS_BD: tl.constexpr, PDL: tl.constexpr, BM: tl.constexpr, BN_O: tl.constexpr,
                    BN_G: tl.constexpr, BN_D: tl.constexpr, BK_O: tl.constexpr, BK_G: tl.constexpr,
                    BK_D: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
                    LOAD_POLL: tl.constexpr):
        """PHASE 0, 1 or 2: that phase alone, launched as a kernel of its
        own (dependent, with ``PDL``, as ``pdl.enter`` has it); 3: all
        three, with the grid-wide waits between them."""
        p = tl.program_id(0)
        programs = tl.num_programs(0)
        rn_o, ok_o = _columns(p, programs, N, BN_O)
        rn_g, ok_g = _columns(p, programs, I, BN_G)
        rn_d, ok_d = _columns(p, programs, N, BN_D)
        if PHASE == 0 or PHASE == 3:
            first_o = _first(wo_ptr, rn_o, ok_o, KO, swo, BK_O)
        if PHASE == 1:
            first_g = _first(wgu_ptr, rn_g, ok_g, N, swgu, BK_G)
            first_u = _first(wgu_ptr + I * swgu, rn_g, ok_g, N, swgu, BK_G)
        if PHASE == 2:
            first_d = _first(wd_ptr, rn_d, ok_d, I, swd, BK_D)
        if PDL:
            tl.extra.cuda.gdc_wait()
            if PHASE != 3:  # a persistent grid lets the next kernel launch only after its last wait
                tl.extra.cuda.gdc_launch_dependents()
        if PHASE == 0 or PHASE == 3:
            _o_phase(first_o, x_ptr, a_ptr, wo_ptr, bo_ptr, h1_ptr, M, N, KO, sx, sa, swo, sh, rn_o,
                     ok_o, HAS_BO, BM, BN_O, BK_O, STAGES, IEEE)
        if PHASE == 3:  # B's first weights asked for before the wait for every program's h1
            first_g = _first(wgu_ptr, rn_g, ok_g, N, swgu, BK_G)
            first_u = _first(wgu_ptr + I * swgu, rn_g, ok_g, N, swgu, BK_G)
            _grid_wait(sync_ptr, programs, LOAD_POLL)
        if PHASE == 1 or PHASE == 3:
            _glu_phase(first_g, first_u, h1_ptr, nw_ptr, wgu_ptr, bgu_ptr, act_ptr, M, N, I, eps, sh,
                       swgu, sact, rn_g, ok_g, HAS_BGU, BM, BN_G, BK_G, STAGES, IEEE)
        if PHASE == 3:  # C's first weights asked for before the wait for every program's act
            first_d = _first(wd_ptr, rn_d, ok_d, I, swd, BK_D)
            _grid_wait(sync_ptr + 2, programs, LOAD_POLL)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
        if PHASE == 2 or PHASE == 3:
            _down_phase(first_d, act_ptr, wd_ptr, bd_ptr, out_ptr, M, N, I, sact, swd, so, rn_d, ok_d,
                        HAS_BD, BM, BN_D, BK_D, STAGES, IEEE)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def new_sync(device: torch.device | str) -> torch.Tensor:
    """The kernel's two waits' ``[count, generation]`` pairs, zero: one per
    model, its layers' launches one after another (each leaves the counts
    at zero)."""
    return torch.zeros(4, dtype=torch.int32, device=device)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def step_k(columns: int) -> int:
    """A phase's step of K for ``columns`` (a power of two) a program:
    ``STEP_WEIGHTS`` weights a step, between 128 and 1024."""
    return min(1024, max(128, STEP_WEIGHTS // columns))


def _check(x, a, w_o, norm_w, w_gu, w_down) -> None:
    m, n = x.shape
    inter = w_down.shape[1]
    if a.shape[0] != m or w_o.shape != (n, a.shape[1]) or norm_w.shape != (n,) \
            or w_gu.shape != (2 * inter, n) or w_down.shape != (n, inter):
        raise ValueError(f"layer_mlp: shapes do not chain: x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"o {tuple(w_o.shape)}, norm {tuple(norm_w.shape)}, gate and up "
                         f"{tuple(w_gu.shape)}, down {tuple(w_down.shape)}")
    if any(t.stride(-1) != 1 for t in (x, a, w_o, w_gu, w_down)):
        raise ValueError("layer_mlp: x, a and the weights must be contiguous along their last dim")
    if m > 16:
        raise ValueError(f"layer_mlp: a decode step of at most 16 rows, not {m}")


def mlp_block(x: torch.Tensor, a: torch.Tensor, w_o: torch.Tensor, b_o: torch.Tensor | None,
              norm_w: torch.Tensor, eps: float, w_gu: torch.Tensor, b_gu: torch.Tensor | None,
              w_down: torch.Tensor, b_down: torch.Tensor | None, sync: torch.Tensor | None, *,
              programs: int, persistent: bool = True, pdl: bool = False,
              warps: int = 4, stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h1, sums)``: ``h1 = x + o(a)`` ``[M, N]`` in x's dtype and the
    down projection's float32 sums ``[1, M, N]`` of ``silu(gate) * up`` of
    ``RMSNorm(h1)``. ``programs``: the grid, at most the GPU's
    multiprocessors where ``persistent`` (one kernel, ``sync`` its
    counters: ``new_sync``), else three kernels. Without Triton on x's
    device: ``torch_mlp_block``."""
    if not available(x):
        _check(x, a, w_o, norm_w, w_gu, w_down)
        return torch_mlp_block(x, a, w_o, b_o, norm_w, eps, w_gu, b_gu, w_down, b_down)
    return launch(x, a, w_o, b_o, norm_w, eps, w_gu, b_gu, w_down, b_down, sync, programs=programs,
                  persistent=persistent, pdl=pdl, warps=warps, stages=stages)


def launch(x, a, w_o, b_o, norm_w, eps, w_gu, b_gu, w_down, b_down, sync, *, programs: int,
           persistent: bool, pdl: bool, warps: int = 4, stages: int = 3, load_poll: bool = False,
           phases: tuple[int, ...] | None = None):
    """``mlp_block``'s kernels on x's device, whatever it is (Triton's
    interpreter runs them on the CPU), its inputs checked first.
    ``load_poll``: the waits poll with loads, not atomics. ``phases``: of
    the three kernels (``persistent`` False), only these (a benchmark's
    view of each phase alone)."""
    _check(x, a, w_o, norm_w, w_gu, w_down)
    m, n = x.shape
    inter = w_down.shape[1]
    h1 = torch.empty_like(x)
    act = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((1, m, n), dtype=torch.float32, device=x.device)
    if persistent and (sync is None or sync.numel() < 4 or sync.dtype != torch.int32):
        raise ValueError("layer_mlp: the persistent kernel needs its int32 counters (new_sync)")
    if persistent and x.is_cuda \
            and programs > torch.cuda.get_device_properties(x.device).multi_processor_count:
        # a program that cannot be placed until another ends would never come to the wait
        raise ValueError(f"layer_mlp: a persistent grid of {programs} programs is more than the "
                         "GPU's multiprocessors")
    args = (x, a, w_o, b_o if b_o is not None else w_o, norm_w, w_gu, b_gu if b_gu is not None else w_gu,
            w_down, b_down if b_down is not None else w_down, h1, act, out,
            sync if sync is not None else out, m, n, a.shape[1], inter, float(eps),
            x.stride(0), a.stride(0), w_o.stride(0), h1.stride(0), w_gu.stride(0), act.stride(0),
            w_down.stride(0), out.stride(1))
    bn_o, bn_g = _block(triton.cdiv(n, programs)), _block(triton.cdiv(inter, programs))
    consts = dict(HAS_BO=b_o is not None, HAS_BGU=b_gu is not None, HAS_BD=b_down is not None,
                  PDL=pdl, BM=_block(m), BN_O=bn_o, BN_G=bn_g, BN_D=bn_o, BK_O=step_k(bn_o),
                  BK_G=step_k(bn_g), BK_D=step_k(bn_o), STAGES=stages, IEEE=x.dtype == torch.float32,
                  LOAD_POLL=load_poll, num_warps=warps, **launch_options(pdl))
    for phase in ((PHASES,) if persistent else phases if phases is not None else range(PHASES)):
        _mlp_kernel[(programs,)](*args, PHASE=phase, **consts)
    return h1, out


def torch_mlp_block(x, a, w_o, b_o, norm_w, eps, w_gu, b_gu, w_down, b_down):
    """``mlp_block`` in torch, with its rounding: the reference."""
    h1 = x + F.linear(a.float(), w_o.float(), None if b_o is None else b_o.float()).to(x.dtype)
    h = rms_norm(h1, norm_w, eps)
    gate, up = F.linear(h.float(), w_gu.float(), None if b_gu is None else b_gu.float()).chunk(2, dim=-1)
    g = gate.to(x.dtype).float()
    act = ((g / (1.0 + torch.exp(-g))).to(x.dtype).float() * up.to(x.dtype).float()).to(x.dtype)
    sums = F.linear(act.float(), w_down.float(), None if b_down is None else b_down.float())
    return h1, sums.unsqueeze(0)
