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

from bubblefree.cuda_backend.tuning import parse_settings

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
    def _rope(ptr, d, cs_ptr, sn_ptr, mask, ROT: tl.constexpr):
        """``ptr[d]`` in float32 after transformers' rotary embedding on its
        first ROT dims (``x * cos + rotate_half(x) * sin``); the rest pass."""
        x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
        if ROT > 0:
            half = ROT // 2
            rot = mask & (d < ROT)
            partner = tl.load(ptr + tl.where(d < half, d + half, d - half), mask=rot,
                              other=0.0).to(tl.float32)
            c = tl.load(cs_ptr + d, mask=rot, other=1.0).to(tl.float32)
            sn = tl.load(sn_ptr + d, mask=rot, other=0.0).to(tl.float32)
            x = x * c + tl.where(d < half, -partner, partner) * sn
        return x

    @triton.jit
    def _new_token(b, h, kvh, d, mask, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                   kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, skn_b, skn_h, svn_b, svn_h, scs_b,
                   GROUP: tl.constexpr, ROT: tl.constexpr):
        """The step's own key (rotated) and value of row ``b`` for query heads
        ``h``, as the cache holds them (its dtype), in float32. The first
        query head of each KV group writes them into the cache at the row's
        slot, for later steps; this step uses them from registers, so no
        program reads a position another program is writing."""
        cs, sn = cs_ptr + b * scs_b, sn_ptr + b * scs_b
        kn = _rope(kn_ptr + b * skn_b + kvh * skn_h, d, cs, sn, mask, ROT)
        kn = kn.to(k_ptr.dtype.element_ty)
        vn = tl.load(vn_ptr + b * svn_b + kvh * svn_h + d, mask=mask, other=0.0)
        vn = vn.to(v_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b)
        writer = mask & (h % GROUP == 0)
        tl.store(k_ptr + slot * sk_t + kvh * sk_h + d, kn, mask=writer)
        tl.store(v_ptr + slot * sv_t + kvh * sv_h + d, vn, mask=writer)
        return kn.to(tl.float32), vn.to(tl.float32)

    @triton.jit
    def _gelu(f, ACT: tl.constexpr):
        """GELU in float32: 1 the tanh form (transformers' gelu_new), 2 erf."""
        if ACT == 1:
            y = 0.7978845608028654 * (f + 0.044715 * f * f * f)
            # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both infinities
            return 0.5 * f * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        else:
            return 0.5 * f * (1.0 + tl.math.erf(f * 0.7071067811865476))

    @triton.jit
    def _activate(src, dst, j, per, n, ACT: tl.constexpr, BLOCK_F: tl.constexpr):
        """``dst[c] = act(src[c])`` for one row's columns ``j * per ..``
        (``per`` of the ``n``): each program of the row takes its share."""
        lo = j * per
        hi = tl.minimum(lo + per, n)
        for c in range(lo, hi, BLOCK_F):
            idx = c + tl.arange(0, BLOCK_F)
            ok = idx < hi
            f = tl.load(src + idx, mask=ok, other=0.0).to(tl.float32)
            tl.store(dst + idx, _gelu(f, ACT).to(dst.dtype.element_ty), mask=ok)

    @triton.jit
    def _one_pass_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, pos_ptr, out_ptr,
                kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, f_ptr, fo_ptr,
                sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, spt_b, so_b, so_h,
                skn_b, skn_h, svn_b, svn_h, scs_b, sf_b, sfo_b, f_per, f_n,
                scale, window,
                GROUP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
                STAGES: tl.constexpr, NEW: tl.constexpr, ROT: tl.constexpr,
                ACT: tl.constexpr, BLOCK_F: tl.constexpr):
        """One row's query heads ``HEADS * j ..`` over its whole context. The
        heads share the page-table walk, and in the ``[tokens, heads, D]``
        cache their keys for one position are one contiguous run. With NEW,
        q arrives before its rotary embedding and the step's own key and
        value come raw (``_new_token``): rotary, the KV write and attention
        in one kernel. With ACT, the row's programs also write act(f) (see
        ``Activation``)."""
        b = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS] query heads
        kvh = h // GROUP
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, BLOCK_D)
        hd_mask = (h[:, None] >= 0) & (d[None, :] < D)  # [HEADS, BLOCK_D]
        # Keys ``start .. pos``; without a sliding window ``window`` is huge.
        start = tl.maximum(pos - window + 1, 0)
        first = (start // BLOCK_N) * BLOCK_N
        if NEW:
            q = _rope(q_ptr + b * sq_b + h[:, None] * sq_h, d[None, :], cs_ptr + b * scs_b,
                      sn_ptr + b * scs_b, hd_mask, ROT)
            kn, vn = _new_token(b, h[:, None], kvh[:, None], d[None, :], hd_mask, k_ptr, v_ptr,
                                sk_t, sk_h, sv_t, sv_h, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr,
                                skn_b, skn_h, svn_b, svn_h, scs_b, GROUP, ROT)
            # The softmax starts from the step's own key (position pos), so
            # the running max is finite from the start; the loop reads the
            # cache below pos.
            m_i = tl.sum(kn * q, 1) * scale
            l_i = tl.full([HEADS], 1.0, tl.float32)
            acc = vn
            end = pos
        else:
            q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + d[None, :], mask=hd_mask,
                        other=0.0).to(tl.float32)
            m_i = tl.full([HEADS], -float("inf"), tl.float32)
            l_i = tl.zeros([HEADS], tl.float32)
            acc = tl.zeros([HEADS, BLOCK_D], dtype=tl.float32)
            end = pos + 1
        offs = tl.arange(0, BLOCK_N)
        k_off = kvh[None, :, None] * sk_h + d[None, None, :]
        v_off = kvh[None, :, None] * sv_h + d[None, None, :]
        for base in tl.range(first, end, BLOCK_N, num_stages=STAGES):
            kpos = base + offs  # [BLOCK_N] key positions
            valid = (kpos < end) & (kpos >= start)
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
        if ACT != 0:
            _activate(f_ptr + b * sf_b, fo_ptr + b * sfo_b, tl.program_id(1), f_per, f_n, ACT,
                      BLOCK_F)

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
                      cs_ptr, sn_ptr,
                      sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, spt_b, scs_b,
                      scale, window, chunk, splits, heads,
                      GROUP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NEW: tl.constexpr,
                      ROT: tl.constexpr):
        """Keys ``s * chunk ..`` of one (row, head): the partial softmax state
        (max, sum, unnormalised output) for ``_combine_kernel``. With NEW, q
        arrives before its rotary embedding and the step's own key (position
        pos) is left to the combining pass, which writes it."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        kvh = h // GROUP
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        if NEW:
            q = _rope(q_ptr + b * sq_b + h * sq_h, d, cs_ptr + b * scs_b, sn_ptr + b * scs_b,
                      dmask, ROT)
            end = pos
        else:
            q = tl.load(q_ptr + b * sq_b + h * sq_h + d, mask=dmask, other=0.0).to(tl.float32)
            end = pos + 1
        start = tl.maximum(pos - window + 1, 0)
        hi = tl.minimum(s * chunk + chunk, end)  # exclusive
        # The first block holds a valid key (``start`` itself, or the chunk's
        # first key): the running max is finite after it, never -inf - -inf.
        # A chunk wholly before ``start`` reads nothing.
        lo = tl.maximum(s * chunk, (start // BLOCK_N) * BLOCK_N)
        hi = tl.where(start < hi, hi, lo)
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
                        q_ptr, k_ptr, v_ptr, kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, f_ptr,
                        fo_ptr,
                        sq_b, sq_h, sk_t, sk_h, sv_t, sv_h, skn_b, skn_h, svn_b, svn_h, scs_b,
                        sf_b, sfo_b, f_per, f_n, scale,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        GROUP: tl.constexpr, NEW: tl.constexpr, ROT: tl.constexpr,
                        ACT: tl.constexpr, BLOCK_F: tl.constexpr):
        """One (row, head): its splits' partial states into the output. An
        empty split (max -inf) weighs exp(-inf) = 0. With NEW the step's own
        key and value join here as one more state (``_new_token``); with ACT
        the row's programs write act(f) as ``_one_pass_kernel``'s do."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        first = (b * heads + h) * splits
        si = tl.arange(0, BLOCK_S)
        smask = si < splits
        m = tl.load(m_ptr + first + si, mask=smask, other=-float("inf"))
        l = tl.load(l_ptr + first + si, mask=smask, other=0.0)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        acc = tl.load(acc_ptr + (first + si)[:, None] * D + d[None, :],
                      mask=smask[:, None] & dmask[None, :], other=0.0)
        if NEW:
            q = _rope(q_ptr + b * sq_b + h * sq_h, d, cs_ptr + b * scs_b, sn_ptr + b * scs_b,
                      dmask, ROT)
            kn, vn = _new_token(b, h, h // GROUP, d, dmask, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                                kn_ptr, vn_ptr, cs_ptr, sn_ptr, slot_ptr, skn_b, skn_h, svn_b,
                                svn_h, scs_b, GROUP, ROT)
            m_new = tl.sum(kn * q, 0) * scale
            top = tl.maximum(tl.max(m, 0), m_new)
            w = tl.exp(m - top)
            w_new = tl.exp(m_new - top)
            out = (tl.sum(w[:, None] * acc, 0) + w_new * vn) / (tl.sum(w * l, 0) + w_new)
        else:
            w = tl.exp(m - tl.max(m, 0))
            out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
        tl.store(out_ptr + b * so_b + h * so_h + d, out.to(out_ptr.dtype.element_ty), mask=dmask)
        if ACT != 0:
            _activate(f_ptr + b * sf_b, fo_ptr + b * sfo_b, h, f_per, f_n, ACT, BLOCK_F)


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
    - rotary and the KV write inside the kernels (``new_token``) took whole
      steps from 1.268 / 1.303 / 1.461 / 1.635 ms to 1.186 / 1.229 / 1.357 /
      1.623 at 1 / 8 / 32 / 64 rows, and Phi's MLP activation with them
      (``mlp_act``) to 1.158 / 1.201 / 1.327 / 1.537
      (docs/runs/profile-rope-2026-11-30.txt).
    Whole steps (``bench.profile_step``, docs/runs/profile-final-2026-11-30.txt
    and docs/performance.md) confirm the choice at each row count."""
    split_below: int = 512
    pipelined_below: int = 2048
    pipelined: Launch = Launch(stages=3)
    plain: Launch = Launch()
    # Fused decode steps: rotary embeddings and the KV write inside the
    # attention kernel (``NewToken``), instead of two compiled kernels before
    # it; and Phi's MLP activation with them (``Activation``), instead of a
    # kernel of its own.
    new_token: bool = True
    mlp_act: bool = True

    def choose(self, rows: int, heads: int, length: int) -> Launch | None:
        """The one-pass launch for a bucket, or None for the split kernel."""
        programs = rows * heads
        if programs < self.split_below and length > split_chunk(length):
            return None
        return self.pipelined if programs < self.pipelined_below else self.plain

    def __str__(self) -> str:
        split = f"split below {self.split_below} programs, " if self.split_below > 0 else ""
        if self.pipelined == self.plain:
            kernels = f"{split}one-pass {self.plain}"
        else:
            kernels = (f"{split}one-pass {self.pipelined} below {self.pipelined_below} "
                       f"programs, {self.plain} from there")
        if not self.new_token:
            return kernels + "; rotary and KV write separate"
        return kernels + ("" if self.mlp_act else "; Phi's MLP activation separate")


DISPATCH = Dispatch()


def forced(split_below: int | None = None, launch: Launch | None = None,
           new_token: bool | None = None, mlp_act: bool | None = None) -> Dispatch:
    """The default dispatch with a split threshold, one launch for every
    one-pass bucket, where the step's own key is written and/or where Phi's
    activation runs imposed (benchmarks and profiles compare them)."""
    out = Dispatch()
    if split_below is not None:
        out = attrs.evolve(out, split_below=split_below)
    if launch is not None:
        out = attrs.evolve(out, pipelined=launch, plain=launch)
    if new_token is not None:
        out = attrs.evolve(out, new_token=new_token)
    if mlp_act is not None:
        out = attrs.evolve(out, mlp_act=mlp_act)
    return out


@attrs.frozen
class NewToken:
    """The step's own key and value, not yet in the cache: k and v ``[B,
    KVH, D]`` as the projection gave them (k before its rotary embedding),
    the rows' rotary tables cos and sin ``[B, ROT]`` (transformers' layout:
    the two halves repeat), and ``slot`` ``[B]``, where each row's key and
    value go in the cache. The kernels then take q before its rotary
    embedding too, and rotary, the KV write and attention run as one."""
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot: torch.Tensor

    def pointers(self) -> tuple:
        return self.k, self.v, self.cos, self.sin, self.slot

    def strides(self) -> tuple[int, ...]:
        return (self.k.stride(0), self.k.stride(1), self.v.stride(0), self.v.stride(1),
                self.cos.stride(0))

    def flags(self) -> dict:
        return {"NEW": True, "ROT": self.cos.shape[1]}


@attrs.frozen
class Activation:
    """A rider on the attention kernels: ``dst = act(src)``, ``[B, I]`` each
    (rows contiguous), the row's programs sharing the columns. Phi's output
    GEMM reads ``[attention | act(fc1)]``; with ``dst`` the tail of the
    attention output's row, no kernel of its own applies the activation or
    builds the concatenation. ``kind``: 1 GELU (tanh form), 2 GELU (erf)."""
    src: torch.Tensor
    dst: torch.Tensor
    kind: int


def _act_args(act: Activation | None, q: torch.Tensor, programs: int) -> tuple:
    """The kernels' activation arguments (placeholders without one), for
    ``programs`` per row."""
    if act is None:
        return (q, q), (0, 0, 0, 0), {"ACT": 0, "BLOCK_F": 16}
    n = act.src.shape[1]
    per = -(-n // programs)
    return ((act.src, act.dst), (act.src.stride(0), act.dst.stride(0), per, n),
            {"ACT": act.kind, "BLOCK_F": min(256, triton.next_power_of_2(per))})


def _new_args(new: NewToken | None, q: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """The kernels' arguments for ``new``; without one, placeholders the
    kernels never read (NEW is a compile-time flag)."""
    if new is None:
        return (q,) * 5, (0,) * 5, {"NEW": False, "ROT": 0}
    return new.pointers(), new.strides(), new.flags()


def one_pass(q, keys, values, page_table, positions, page_size: int, scale: float,
             window: int, out: torch.Tensor, launch: Launch, new: NewToken | None = None,
             act: Activation | None = None) -> torch.Tensor:
    """The one-pass kernel into ``out``; ``launch.heads`` is cut to a power of
    two dividing the head count. With ``new``, q is before its rotary
    embedding and the step's own key and value are written and attended;
    with ``act``, that activation rides along."""
    b, h, d = q.shape
    heads = math.gcd(launch.heads, h)
    pointers, strides, flags = _new_args(new, q)
    act_pointers, act_strides, act_flags = _act_args(act, q, h // heads)
    _one_pass_kernel[(b, h // heads)](
        q, keys, values, page_table, positions, out, *pointers, *act_pointers,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        *strides, *act_strides, scale, window,
        GROUP=h // keys.shape[1], PS=page_size, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=launch.block_n, HEADS=heads, STAGES=launch.stages, num_warps=launch.warps,
        **flags, **act_flags)
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


def run(q, keys, values, page_table, positions, page_size: int, scale: float, window: int,
        split: int = -1, new: NewToken | None = None,
        out: torch.Tensor | None = None, act: Activation | None = None) -> torch.Tensor:
    """The kernel ``DISPATCH`` picks for these shapes (``split`` < 0), or
    the split kernel (1) or the one-pass kernel (0), into ``out`` ``[B, H,
    Dv]`` (a new one by default)."""
    b, h, d = q.shape
    if out is None:
        out = torch.empty((b, h, values.shape[2]), dtype=q.dtype, device=q.device)
    length = page_table.shape[1] * page_size
    # A bucket's shapes are fixed at capture, so is this choice.
    launch = DISPATCH.choose(b, h, length) if split < 0 else None if split else DISPATCH.plain
    if launch is None:
        _split_attention(q, keys, values, page_table, positions, page_size, scale, window, out,
                         new, act)
    else:
        one_pass(q, keys, values, page_table, positions, page_size, scale, window, out, launch,
                 new, act)
    return out


# A custom op, so torch.compile treats the kernel as one opaque call (its fake
# gives the output's shape) instead of recompiling the Triton source itself.
@torch.library.custom_op("bubblefree::paged_decode", mutates_args=())
def _paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                  scale: float, window: int, split: int) -> torch.Tensor:
    return run(q, keys, values, page_table, positions, page_size, scale, window, split)


@_paged_decode.register_fake
def _(q, keys, values, page_table, positions, page_size, scale, window, split):
    return q.new_empty((q.shape[0], q.shape[1], values.shape[2]))


def _split_attention(q, keys, values, page_table, positions, page_size: int, scale: float,
                     window: int, out: torch.Tensor | None = None,
                     new: NewToken | None = None, act: Activation | None = None) -> torch.Tensor:
    """Flash-decoding: each (row, head) spread over programs of ``chunk``
    keys, then one combining pass. A (row, head) program walking its pages
    one dependent load after another was latency-bound at short contexts
    (20 us per layer at 32 rows and 128 positions, where the bytes need 10);
    here each program makes one or two such steps. ``new`` and ``act`` as
    in ``one_pass``: the combining pass writes and adds the step's own key,
    and applies the activation."""
    b, h, d = q.shape
    length = page_table.shape[1] * page_size
    chunk = split_chunk(length)
    splits = triton.cdiv(length, chunk)
    m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty((b, h, values.shape[2]), dtype=q.dtype, device=q.device)
    pointers, strides, flags = _new_args(new, q)
    act_pointers, act_strides, act_flags = _act_args(act, q, h)
    group = h // keys.shape[1]
    _split_kernel[(b, h, splits)](
        q, keys, values, page_table, positions, m, l, acc, pointers[2], pointers[3],
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), page_table.stride(0), strides[4],
        scale, window, chunk, splits, h,
        GROUP=group, PS=page_size, D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=32, num_warps=2, **flags)
    _combine_kernel[(b, h)](
        m, l, acc, out, splits, h, out.stride(0), out.stride(1), q, keys, values, *pointers,
        *act_pointers, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), *strides, *act_strides, scale,
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=triton.next_power_of_2(splits),
        GROUP=group, num_warps=2, **flags, **act_flags)
    return out
