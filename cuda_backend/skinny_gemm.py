"""A GEMM for decode-sized inputs (Triton, CUDA): ``x [M, K] @ w[N, K]^T``
with M of 1-64 rows, where the whole cost is one pass over the weights.

Each program owns ``BLOCK_N`` output columns and one of ``split`` slices
of K (whole steps of ``BLOCK_K``, as equal as they divide), and multiplies
all M rows at once, so every weight byte is read once. With ``split`` > 1
the programs write float32 partial sums ``[split, M, N]`` and a second
kernel adds them and the bias; with 1 the program adds the bias and writes
the output in x's dtype.

``linear`` runs the kernel where the backend's ``kernel_config.TileTable``
has a tile for the weight's shape and row count (by default the tiles
``bench.gemm_tune`` measured faster than cuBLAS on this GPU,
``measured.MEASURED``) and ``F.linear`` everywhere else. It is a custom
op, so a compiled decode step calls it as one opaque call.

The decode step with dependent launches (``KernelConfig.pdl``,
``pdl_step``) calls ``launch`` itself: every GEMM through the kernel, the
output projections' partial sums handed to the next norm instead of a
reduction kernel, the first weights read before the previous kernel ends,
(``glu``) Llama's gate and up projections ending in ``silu(gate) * up``,
and at one row Llama's and Qwen2's output projection combining the split
attention kernel's partial states as it reads them (``paged_decode.States``,
``KernelConfig.o_combines``).

A tile written with ``v`` runs the vector form instead (``skinny_gemv``:
no MMA, each program's whole share of the weights read before the wait),
for up to eight rows of 16-bit weights; x given as attention's states
always runs the MMA form. A tile written with a trailing ``e`` lets the
next kernel launch before it loads and waits (``Tile.early``), in
either form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bubblefree.cuda_backend.kernel_config import Tile, TileTable, tile_for
from bubblefree.cuda_backend.paged_decode import States, tl_dtype
from bubblefree.cuda_backend.pdl import enter, launch_options, release, tl, triton, wait
from bubblefree.cuda_backend import skinny_gemv


if triton is not None:

    @triton.jit
    def _mma(acc, x, w, IEEE: tl.constexpr):
        if IEEE:  # float32 inputs: full precision, as cuBLAS gives them here
            out = acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            out = acc + tl.dot(x, tl.trans(w))
        return out

    @triton.jit
    def _states_block(acc_ptr, m_ptr, l_ptr, k0, heads, ROWS: tl.constexpr,
                      BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, S: tl.constexpr,
                      BLOCK_S: tl.constexpr, HD: tl.constexpr, DT: tl.constexpr):
        """Columns ``k0 ..`` (WIDTH of them, whole heads of HD) of x's first
        ROWS rows, x being attention left as S partial states per (row,
        head) (``paged_decode.States``): each row's heads combined as the
        split kernel's combining pass combines them, rounded to DT; the
        rows past ROWS zero. One load each of a row's maxima, sums and
        outputs, all rows' asked for at once."""
        HK: tl.constexpr = WIDTH // HD
        hh = k0 // HD + tl.arange(0, HK)
        ss = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, HD)
        ok = (ss < S)[None, :]
        rm = tl.arange(0, BLOCK_M)
        x = tl.zeros([BLOCK_M, WIDTH], dtype=DT)
        for r in tl.static_range(ROWS):
            at = (r * heads + hh)[:, None] * S + ss[None, :]  # [HK, BLOCK_S]
            m = tl.load(m_ptr + at, mask=ok, other=-float("inf"))
            l = tl.load(l_ptr + at, mask=ok, other=0.0)
            acc = tl.load(acc_ptr + at[:, :, None] * HD + dd[None, None, :], mask=ok[:, :, None],
                          other=0.0)
            w = tl.exp(m - tl.max(m, 1)[:, None])
            row = tl.sum(w[:, :, None] * acc, 1) / tl.sum(w * l, 1)[:, None]  # [HK, HD]
            row = tl.reshape(row.to(DT), [WIDTH])
            x = tl.where(rm[:, None] == r, row[None, :], x)
        return x

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, steps, sx_m, sw_n, so_s, so_m, up_off,
                m_ptr, l_ptr, heads,
                HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr,
                GLU: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                AHEAD: tl.constexpr, STATES: tl.constexpr, BLOCK_S: tl.constexpr,
                HD: tl.constexpr, DT: tl.constexpr, ROWS: tl.constexpr,
                EARLY: tl.constexpr = False):
        """K is ``steps`` steps of BLOCK_K; slice s of the grid's takes steps
        ``s * steps // slices`` up to the next slice's first. GLU: w is
        ``[gate; up]`` (up from row ``up_off``) and the output column j is
        ``silu(gate_j) * up_j``, each rounded to x's dtype as torch's ops
        round them. PDL: the slice's first AHEAD steps of weights are read
        before the wait (``Tile.ahead``). STATES: x is attention's partial
        states, combined as they are read (``_states_block``); each slice
        is then AHEAD steps, read whole before the wait, and no loop runs
        (a pipelined loop over states would stage them all in shared
        memory). EARLY (with PDL): the next kernel may launch before this
        one reads and waits (``pdl.release``)."""
        if EARLY:
            release(PDL)
        n0 = tl.program_id(0) * BLOCK_N
        s = tl.program_id(1)
        slices = tl.num_programs(1)
        rm = tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None] * sw_n
        u_rows = w_ptr + (rn + up_off)[:, None] * sw_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k0 = (s * steps // slices) * BLOCK_K
        k1 = ((s + 1) * steps // slices) * BLOCK_K
        start = k0
        if PDL or STATES > 0:  # the first steps' weights are read while the previous kernel ends
            # Names of their own: these tiles are AHEAD steps wide, the loop's one,
            # and a name the loop reassigns must keep one shape to compile.
            ra = tl.arange(0, AHEAD * BLOCK_K)
            w0 = tl.load(w_rows + (k0 + ra)[None, :], mask=n_ok[:, None], other=0.0)
            if GLU:
                wu0 = tl.load(u_rows + (k0 + ra)[None, :], mask=n_ok[:, None], other=0.0)
            if EARLY:
                wait(PDL)
            else:
                enter(PDL)
            if STATES > 0:
                x0 = _states_block(x_ptr, m_ptr, l_ptr, k0, heads, ROWS, BLOCK_M,
                                   AHEAD * BLOCK_K, STATES, BLOCK_S, HD, DT)
            else:
                x0 = tl.load(x_ptr + rm[:, None] * sx_m + (k0 + ra)[None, :],
                             mask=m_ok[:, None], other=0.0)
            acc = _mma(acc, x0, w0, IEEE)
            if GLU:
                acc_up = _mma(acc_up, x0, wu0, IEEE)
            start = k0 + AHEAD * BLOCK_K
        if STATES == 0:
            for k in tl.range(start, k1, BLOCK_K, num_stages=STAGES):
                x = tl.load(x_ptr + rm[:, None] * sx_m + (k + rk)[None, :], mask=m_ok[:, None],
                            other=0.0)
                w = tl.load(w_rows + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
                acc = _mma(acc, x, w, IEEE)
                if GLU:
                    wu = tl.load(u_rows + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
                    acc_up = _mma(acc_up, x, wu, IEEE)
        mask = m_ok[:, None] & n_ok[None, :]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if PARTIAL:  # partial sums: the first slice carries it
                bias = tl.where(s == 0, bias, 0.0)
            acc += bias[None, :]
            if GLU:
                acc_up += tl.load(b_ptr + rn + up_off, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if PARTIAL:
            tl.store(out_ptr + s * so_s + rm[:, None] * so_m + rn[None, :], acc, mask=mask)
        else:
            dtype = out_ptr.dtype.element_ty
            if GLU:
                g = acc.to(dtype).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
                acc = a * acc_up.to(dtype).to(tl.float32)
            tl.store(out_ptr + rm[:, None] * so_m + rn[None, :], acc.to(dtype), mask=mask)

    @triton.jit
    def _reduce_kernel(p_ptr, b_ptr, out_ptr, total, N, splits,
                       HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < total
        enter(PDL)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(splits):
            acc += tl.load(p_ptr + s * total + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def launch(x: "torch.Tensor | States", w: torch.Tensor, bias: torch.Tensor | None, tile: Tile,
           *, bias_in_parts: bool = False, glu: bool = False, pdl: bool = False,
           partial: bool | None = None) -> torch.Tensor:
    """``[split, M, N]`` float32 partial sums when ``tile.split`` > 1 (or
    ``partial``), else ``[M, N]`` in x's dtype with the bias. Partial sums
    leave the bias out unless ``bias_in_parts`` (the first slice's sums then
    carry it). ``glu``: w (and the bias) are ``[gate; up]`` and the output,
    ``[M, N / 2]``, is ``silu(gate) * up`` (Llama's and Qwen2's MLP; K
    whole, no partial sums). ``pdl``: launched dependent on the previous
    kernel (``cuda_backend.pdl``). x may be attention's partial states
    (``paged_decode.States``), x being their combination ``[M, H * D]``:
    the kernel combines them as it reads them; each step of K is then whole
    heads and each slice ``tile.ahead`` steps (``pdl_step.states_tile``)."""
    states = x if isinstance(x, States) else None
    if states is not None:
        rows, heads, splits, hd = states.acc.shape
        if tile.block_k % hd or hd & (hd - 1) or heads * hd != w.shape[1] \
                or heads * hd != tile.split * tile.ahead * tile.block_k:
            raise ValueError(f"skinny_gemm: states need steps of K ({tile.block_k}) of whole "
                             f"heads of {hd} (a power of two), each slice {tile.ahead} of them")
        if not (states.acc.is_contiguous() and states.m.is_contiguous()
                and states.l.is_contiguous()):
            raise ValueError("skinny_gemm: states' m, l and acc must be contiguous")
        x = states.acc.view(rows, heads * splits * hd)[:, :heads * hd]  # its shape, for checks
        x_dtype = states.dtype
    else:
        x_dtype = x.dtype
    m, k = x.shape
    n = w.shape[0] // 2 if glu else w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_gemm: x and w must be contiguous along K")
    if w.shape[1] != k:
        raise ValueError(f"skinny_gemm: w {tuple(w.shape)} does not take x's K={k}")
    if not tile.fits(k):
        raise ValueError(f"skinny_gemm: K={k} is not {tile.split} slices of at least "
                         f"{tile.ahead} steps of {tile.block_k}")
    partial = tile.split > 1 if partial is None else partial or tile.split > 1
    if glu and (partial or w.shape[0] % 2):
        raise ValueError("skinny_gemm: a GLU output needs K whole and [gate; up] of equal rows")
    vector = tile.vector and states is None
    if vector:
        width = skinny_gemv.slice_width(k // tile.block_k, tile.split, tile.block_k)
        skinny_gemv.check(tile, m, w.dtype, width, glu)  # the weights held in registers
    if partial:
        out = torch.empty((tile.split, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x_dtype, device=x.device)
    if vector:
        skinny_gemv._gemv_kernel[(triton.cdiv(n, tile.block_n), tile.split)](
            x, w, bias if bias is not None else w, out, n, k // tile.block_k, x.stride(0),
            w.stride(0), out.stride(0) if partial else 0, out.stride(-2), n,
            HAS_BIAS=bias is not None and (not partial or bias_in_parts), PARTIAL=partial,
            GLU=glu, PDL=pdl, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SLICE=width, ROWS=m,
            EARLY=bool(tile.early) and pdl, num_warps=tile.warps, **launch_options(pdl))
        return out
    _gemm_kernel[(triton.cdiv(n, tile.block_n), tile.split)](
        x, w, bias if bias is not None else w, out, m, n, k // tile.block_k,
        x.stride(0), w.stride(0), out.stride(0) if partial else 0, out.stride(-2), n,
        states.m if states else w, states.l if states else w, states.acc.shape[1] if states else 0,
        HAS_BIAS=bias is not None and (not partial or bias_in_parts), PARTIAL=partial,
        IEEE=x_dtype == torch.float32, GLU=glu, PDL=pdl,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, STAGES=tile.stages, AHEAD=tile.ahead if pdl or states else 1,
        STATES=states.acc.shape[2] if states else 0,
        BLOCK_S=triton.next_power_of_2(states.acc.shape[2]) if states else 1,
        HD=states.acc.shape[3] if states else 1, DT=tl_dtype(x_dtype), ROWS=m if states else 1,
        EARLY=bool(tile.early) and pdl, num_warps=tile.warps, **launch_options(pdl))
    return out


def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile: Tile, *,
        pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through the kernel, partial sums reduced."""
    parts = launch(x, w, bias, tile, pdl=pdl)
    if tile.split == 1:
        return parts
    _, m, n = parts.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = 1024
    _reduce_kernel[(triton.cdiv(m * n, block),)](
        parts, bias if bias is not None else parts, out, m * n, n, tile.split,
        HAS_BIAS=bias is not None, PDL=pdl, BLOCK=block, num_warps=4, **launch_options(pdl))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           tiles: TileTable) -> torch.Tensor:
    """``F.linear`` for 2-D x, through the kernel where ``tiles`` has a tile
    for w's shape (the row count decides inside the op, at capture)."""
    entries = tiles.scalars(w.shape[1], w.shape[0])
    if entries and available(x):
        return _skinny_linear(x, w, bias, entries)
    return F.linear(x, w, bias)


# The op takes its shape's entries as integers (TileTable.scalars): an op's
# arguments are tensors and scalars.
@torch.library.custom_op("bubblefree::skinny_linear", mutates_args=())
def _skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   tiles: list[int]) -> torch.Tensor:
    tile = tile_for(tiles, x.shape[0])
    # The table only ever speeds things up: anything it cannot serve is cuBLAS's.
    if (tile is None or not available(x) or not tile.fits(x.shape[1]) or x.stride(1) != 1
            or w.stride(1) != 1):
        return F.linear(x, w, bias)
    return run(x, w, bias, tile)


@_skinny_linear.register_fake
def _(x, w, bias, tiles):
    return x.new_empty((x.shape[0], w.shape[0]))
