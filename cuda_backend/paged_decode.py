"""Decode attention that reads each row's KV pages in place (Triton, CUDA).

The portable path (``attention._decode_attention``) gathers every row's keys
and values into a dense ``[B, L, KVH, D]`` copy of its page bucket, then
permutes them for two batched matmuls: at 32 rows that is several full
passes over L = the bucket's length, most of it past the row's real
context (measured: over half of an H200 decode step; docs/benchmarks.md).
These kernels instead walk the row's page table and read only positions
``start .. pos`` once, with an online softmax in float32. Two kernels:

- one-pass: one program per (row, query head), or per row and a few of
  its heads, walks the whole context, BLOCK_N keys per iteration;
- split (flash-decoding): each (row, head) is spread over programs of
  ``split_chunk`` keys, whose partial softmax states a second pass combines.
  A program's page-table lookups and key loads depend on each other, so a
  lone program walking a long context is latency-bound; splitting helps
  when there are few (row, head) pairs to overlap, and costs when there are
  many (``Dispatch`` records the measurements).

Used on CUDA when Triton imports; everywhere else the portable path runs.
Shapes: q ``[B, H, D]``, keys/values ``[N * page_size, KVH, D]``, page table
``[B, P]``, positions ``[B]`` (the query's position; keys ``<= pos``).
"""

from __future__ import annotations

import math

import attrs
import torch

from cuda_backend.tuning import parse_settings

try:  # Triton ships with CUDA builds of torch; CPU-only installs lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


NO_WINDOW = 1 << 30  # a window no context reaches: every key up to pos


def available(q: torch.Tensor) -> bool:
    return triton is not None and q.is_cuda


if triton is not None:

    @triton.jit
    def _kernel(q_ptr, k_ptr, v_ptr, pt_ptr, pos_ptr, out_ptr,
                sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, spt_b, so_b, so_h,
                scale, window,
                GROUP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
                STAGES: tl.constexpr):
        """One row's query heads ``HEADS * j ..`` over its whole context. The
        heads share the page-table walk, and in the ``[tokens, heads, D]``
        cache their keys for one position are one contiguous run."""
        b = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS] query heads
        kvh = h // GROUP
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, BLOCK_D)
        hd_mask = (h[:, None] >= 0) & (d[None, :] < D)  # [HEADS, BLOCK_D]
        q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :], mask=hd_mask,
                    other=0.0).to(tl.float32)
        # Keys ``start .. pos``; without a sliding window ``window`` is huge.
        start = tl.maximum(pos - window + 1, 0)
        first = (start // BLOCK_N) * BLOCK_N
        m_i = tl.full([HEADS], -float("inf"), tl.float32)
        l_i = tl.zeros([HEADS], tl.float32)
        acc = tl.zeros([HEADS, BLOCK_D], dtype=tl.float32)
        offs = tl.arange(0, BLOCK_N)
        k_off = kvh[None, :, None] * sk_h + d[None, None, :]
        v_off = kvh[None, :, None] * sv_h + d[None, None, :]
        for base in tl.range(first, pos + 1, BLOCK_N, num_stages=STAGES):
            kpos = base + offs  # [BLOCK_N] key positions
            valid = (kpos <= pos) & (kpos >= start)
            page = tl.load(pt_ptr + b * spt_b + kpos // PS, mask=valid, other=0)
            tok = page * PS + kpos % PS  # [BLOCK_N] flat KV index
            kv_mask = valid[:, None, None] & hd_mask[None, :, :]
            k = tl.load(k_ptr + tok[:, None, None] * sk_t + k_off, mask=kv_mask,
                        other=0.0).to(tl.float32)
            s = tl.sum(k * q[None, :, :], 2) * scale  # [BLOCK_N, HEADS]
            s = tl.where(valid[:, None], s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            v = tl.load(v_ptr + tok[:, None, None] * sv_t + v_off, mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 0)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * so_b + h[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hd_mask)

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                      sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, spt_b,
                      scale, window, chunk, splits, heads,
                      GROUP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys ``s * chunk ..`` of one (row, head): the partial softmax state
        (max, sum, unnormalised output) for ``_combine_kernel``."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kvh = h // GROUP
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + b * sq_b + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
        start = tl.maximum(pos - window + 1, 0)
        hi = tl.minimum(s * chunk + chunk, pos + 1)  # exclusive
        # The first block holds a valid key (``start`` itself, or the chunk's
        # first key): the running max is finite after it, never -inf - -inf.
        lo = tl.maximum(s * chunk, (start // BLOCK_N) * BLOCK_N)
        m_i = tl.full([], -float("inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for base in range(lo, hi, BLOCK_N):
            kpos = base + offs
            valid = (kpos < hi) & (kpos >= start)
            page = tl.load(pt_ptr + b * spt_b + kpos // PS, mask=valid, other=0)
            tok = page * PS + kpos % PS
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + tok[:, None] * sk_t + kvh * sk_h + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            sc = tl.sum(k * q[None, :], 1) * scale
            sc = tl.where(valid, sc, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            v = tl.load(v_ptr + tok[:, None] * sv_t + kvh * sv_h + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        at = (b * heads + h) * splits + s
        tl.store(m_ptr + at, m_i)
        tl.store(l_ptr + at, l_i)
        tl.store(acc_ptr + at * D + d, acc, mask=dmask)

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, splits, heads, so_b, so_h,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One (row, head): its splits' partial states into the output. An
        empty split (max -inf) weighs exp(-inf) = 0."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        first = (b * heads + h) * splits
        si = tl.arange(0, BLOCK_S)
        smask = si < splits
        m = tl.load(m_ptr + first + si, mask=smask, other=-float("inf"))
        l = tl.load(l_ptr + first + si, mask=smask, other=0.0)
        w = tl.exp(m - tl.max(m, 0))
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        acc = tl.load(acc_ptr + (first + si)[:, None] * D + d[None, :],
                      mask=smask[:, None] & dmask[None, :], other=0.0)
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
        tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


@attrs.frozen
class Launch:
    """How the one-pass kernel runs: query heads per program (sharing one
    page-table walk), keys per loop iteration, warps per program, and the
    software-pipelining stages of the key loop. Written ``4x32w4s1``."""
    heads: int = 1
    block_n: int = 16
    warps: int = 1
    stages: int = 1

    def __str__(self) -> str:
        return f"{self.heads}x{self.block_n}w{self.warps}s{self.stages}"

    @classmethod
    def parse(cls, text: str) -> "Launch":
        launch = parse_settings(cls, r"(\d+)x(\d+)w(\d+)s(\d+)", "kernel launch",
                                "HEADSxBLOCKwWARPSsSTAGES, e.g. 4x32w4s1",
                                text, ("heads", "block_n", "warps"))
        if launch.stages < 1:
            raise ValueError(f"kernel launch {text!r}: stages must be at least 1")
        return launch


@attrs.frozen
class Dispatch:
    """Which kernel, and which launch of it, a decode bucket runs. A bucket's
    rows and page count are fixed when its graph is captured, so the choice
    is made then, from the count of (row, head) programs: the split kernel
    below ``split_below``; the one-pass kernel with a pipelined key loop
    below ``pipelined_below``; without pipelining from there.

    Measured on the H200 in graphs, each launch reading pages the previous
    one did not, as in a step (``bench.attention_tune``,
    docs/runs/attention-tune-2026-11-30.txt; 32 heads of 64, bf16):
    - split wins at 1 and 8 rows (256 programs): 5.6 against 6.7 us at 128
      keys, 19 against 21 at 8 rows and 512 keys; it loses at 32 rows (1,024
      programs): 19.8 against 14.0. The threshold lies between.
    - one warp and 16 keys per iteration is the best one-pass launch at 32
      and 64 rows: the earlier launch (two warps, 32 keys) took 21-74%
      longer. With one warp the online softmax's reductions stay inside the
      warp instead of crossing through shared memory.
    - a three-stage pipelined key loop pays at 32 rows (14.0 against 15.8 us
      at 128 keys, 38 against 52 at 512) and not at 64 (23.2 against 21.4 at
      128 keys; even at 512).
    - several query heads per program never won by more than 3% without
      grouped heads, so ``heads`` stays 1 (models with grouped KV heads have
      not been measured).
    Whole steps (``bench.profile_step``, docs/runs/profile-final-2026-11-30.txt
    and docs/performance.md) confirm the choice at each row count."""
    split_below: int = 512
    pipelined_below: int = 2048
    pipelined: Launch = Launch(stages=3)
    plain: Launch = Launch()

    def choose(self, rows: int, heads: int, length: int) -> Launch | None:
        """The one-pass launch for a bucket, or None for the split kernel."""
        programs = rows * heads
        if programs < self.split_below and length > split_chunk(length):
            return None
        return self.pipelined if programs < self.pipelined_below else self.plain

    def __str__(self) -> str:
        split = f"split below {self.split_below} programs, " if self.split_below > 0 else ""
        if self.pipelined == self.plain:
            return f"{split}one-pass {self.plain}"
        return (f"{split}one-pass {self.pipelined} below {self.pipelined_below} programs, "
                f"{self.plain} from there")


DISPATCH = Dispatch()


def forced(split_below: int | None = None, launch: Launch | None = None) -> Dispatch:
    """The default dispatch with a split threshold and/or one launch for
    every one-pass bucket imposed (benchmarks and profiles compare them)."""
    out = Dispatch()
    if split_below is not None:
        out = attrs.evolve(out, split_below=split_below)
    if launch is not None:
        out = attrs.evolve(out, pipelined=launch, plain=launch)
    return out


def one_pass(q, keys, values, page_table, positions, page_size: int, scale: float,
             window: int, out: torch.Tensor, launch: Launch) -> torch.Tensor:
    """The one-pass kernel into ``out``; ``launch.heads`` is cut to a power of
    two dividing the head count."""
    b, h, d = q.shape
    heads = math.gcd(launch.heads, h)
    _kernel[(b, h // heads)](
        q, keys, values, page_table, positions, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        scale, window,
        GROUP=h // keys.shape[1], PS=page_size, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=launch.block_n, HEADS=heads, STAGES=launch.stages, num_warps=launch.warps)
    return out


def split_chunk(length: int) -> int:
    """Keys per program of the split kernel: 32, or more so that a bucket of
    ``length`` keys needs at most 64 programs per (row, head)."""
    per = -(-length // 64)
    return max(32, 1 << (per - 1).bit_length())


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                           scaling: float | None, window: int | None,
                           split: bool | None = None) -> torch.Tensor:
    """One query per row over its own pages; returns ``[B, H, Dv]`` in q's
    dtype. ``split`` picks the kernel (None: ``DISPATCH`` decides)."""
    if keys.stride(2) != 1 or values.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode_attention: the head dimension must be contiguous")
    scale = scaling if scaling is not None else q.shape[2] ** -0.5
    return _paged_decode(q, keys, values, page_table, positions, page_size, float(scale),
                         int(window) if window is not None else NO_WINDOW,
                         -1 if split is None else int(split))


# A custom op, so torch.compile treats the kernel as one opaque call (its fake
# gives the output's shape) instead of recompiling the Triton source itself.
@torch.library.custom_op("bubblefree::paged_decode", mutates_args=())
def _paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                  scale: float, window: int, split: int) -> torch.Tensor:
    b, h, d = q.shape
    out = torch.empty((b, h, values.shape[2]), dtype=q.dtype, device=q.device)
    length = page_table.shape[1] * page_size
    # A bucket's shapes are fixed at capture, so is this choice.
    launch = DISPATCH.choose(b, h, length) if split < 0 else None if split else DISPATCH.plain
    if launch is None:
        _split_attention(q, keys, values, page_table, positions, page_size, scale, window, out)
    else:
        one_pass(q, keys, values, page_table, positions, page_size, scale, window, out, launch)
    return out


@_paged_decode.register_fake
def _(q, keys, values, page_table, positions, page_size, scale, window, split):
    return q.new_empty((q.shape[0], q.shape[1], values.shape[2]))


def _split_attention(q, keys, values, page_table, positions, page_size: int, scale: float,
                     window: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-decoding: each (row, head) spread over programs of ``chunk``
    keys, then one combining pass. A (row, head) program walking its pages
    one dependent load after another was latency-bound at short contexts
    (20 us per layer at 32 rows and 128 positions, where the bytes need 10);
    here each program makes one or two such steps."""
    b, h, d = q.shape
    length = page_table.shape[1] * page_size
    chunk = split_chunk(length)
    splits = triton.cdiv(length, chunk)
    m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty((b, h, values.shape[2]), dtype=q.dtype, device=q.device)
    _split_kernel[(b, h, splits)](
        q, keys, values, page_table, positions, m, l, acc,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), page_table.stride(0),
        scale, window, chunk, splits, h,
        GROUP=h // keys.shape[1], PS=page_size, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=32, num_warps=2)
    _combine_kernel[(b, h)](
        m, l, acc, out, splits, h, out.stride(0), out.stride(1),
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=triton.next_power_of_2(splits),
        num_warps=2)
    return out
