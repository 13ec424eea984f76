"""Decode attention that reads each row's KV pages in place (Triton, CUDA):
the entry points, and the marshalling of tensors into the kernels'
arguments. The kernels are in ``paged_decode_kernels``; which of them a
bucket runs is a ``kernel_config.Dispatch``, passed in.

The portable path (``attention._decode_attention``) gathers every row's keys
and values into a dense ``[B, L, KVH, D]`` copy of its page bucket; these
kernels walk the row's page table instead and read only positions ``start
.. pos``, once (why that matters, and how the dispatch was measured:
docs/performance.md, "The attention kernels: measured per bucket").

Used on CUDA when Triton imports; everywhere else the portable path runs.
Shapes: q ``[B, H, D]``, keys/values ``[N * page_size, KVH, D]``, page table
``[B, P]``, positions ``[B]`` (the query's position; keys ``<= pos``).
"""

from __future__ import annotations

import math

import attrs
import torch

from bubblefree.cuda_backend import paged_decode_kernels as kernels
from bubblefree.cuda_backend.kernel_config import Dispatch, Launch, split_chunk
from bubblefree.cuda_backend.pdl import launch_options

NO_WINDOW = 1 << 30  # a window no context reaches: every key up to pos


def available(q: torch.Tensor) -> bool:
    return kernels.triton is not None and q.is_cuda


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1."""
    return 1 << (n - 1).bit_length()


# What the kernels round summed slices to (``NewToken.dtype``).
_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def tl_dtype(dtype: torch.dtype):
    """``dtype`` as the kernels take it (a Triton dtype)."""
    return getattr(kernels.tl, _TL_DTYPES[dtype])


@attrs.frozen
class NewToken:
    """The step's own key and value, not yet in the cache: k and v ``[B,
    KVH, D]`` as the projection gave them (k before its rotary embedding),
    the rows' rotary tables cos and sin ``[B, ROT]`` (transformers' layout:
    the two halves repeat), and ``slot`` ``[B]``, where each row's key and
    value go in the cache. The kernels then take q before its rotary
    embedding too, and rotary, the KV write and attention run as one.

    ``slices`` > 1: q, k and v are the first of that many float32 slices of
    the projection's partial sums, ``slice_stride`` elements apart; the
    kernels add them and round the sum to ``dtype``, the projection's
    output dtype (and the attention output's)."""
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot: torch.Tensor
    slices: int = 1
    slice_stride: int = 0
    dtype: torch.dtype | None = None

    def rotary_args(self) -> dict:
        """The rotary tables and the slices, as every kernel names them."""
        dtype = self.dtype if self.dtype is not None else self.k.dtype
        return {"cs_ptr": self.cos, "sn_ptr": self.sin, "scs_b": self.cos.stride(0),
                "sp_s": self.slice_stride, "SLICES": self.slices,
                "DT": tl_dtype(dtype)}

    def token_args(self) -> dict:
        """The own key and value and their slots, as the kernels that write
        and attend them (one-pass, combine) name them."""
        return {"kn_ptr": self.k, "vn_ptr": self.v, "slot_ptr": self.slot,
                "skn_b": self.k.stride(0), "skn_h": self.k.stride(1),
                "svn_b": self.v.stride(0), "svn_h": self.v.stride(1)}

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


def out_dtype(q: torch.Tensor, new: NewToken | None) -> torch.dtype:
    """The attention output's dtype: q's, or with slices of sums the dtype
    they are rounded to."""
    return new.dtype if new is not None and new.dtype is not None else q.dtype


def _rotary_args(new: NewToken | None, q: torch.Tensor) -> dict:
    """``new``'s rotary arguments and flags; without one, placeholders the
    kernels never read (NEW is a compile-time flag)."""
    if new is None:
        return {"cs_ptr": q, "sn_ptr": q, "scs_b": 0, "sp_s": 0, "SLICES": 1,
                "DT": kernels.tl.float32, "NEW": False, "ROT": 0}
    return {**new.rotary_args(), **new.flags()}


def _token_args(new: NewToken | None, q: torch.Tensor) -> dict:
    """``new``'s own-key arguments, or placeholders as in ``_rotary_args``."""
    if new is None:
        return {"kn_ptr": q, "vn_ptr": q, "slot_ptr": q, "skn_b": 0, "skn_h": 0, "svn_b": 0,
                "svn_h": 0}
    return new.token_args()


def _act_args(act: Activation | None, q: torch.Tensor, programs: int) -> dict:
    """The kernels' activation arguments (placeholders without one), for
    ``programs`` per row."""
    if act is None:
        return {"f_ptr": q, "fo_ptr": q, "sf_b": 0, "sfo_b": 0, "f_per": 0, "f_n": 0, "ACT": 0,
                "BLOCK_F": 16}
    n = act.src.shape[1]
    per = -(-n // programs)
    return {"f_ptr": act.src, "fo_ptr": act.dst, "sf_b": act.src.stride(0),
            "sfo_b": act.dst.stride(0), "f_per": per, "f_n": n, "ACT": act.kind,
            "BLOCK_F": min(256, _next_power_of_2(per))}


def _cache_args(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> dict:
    """The query's and the cache's strides, as every kernel names them."""
    return {"sq_b": q.stride(0), "sq_h": q.stride(1), "sk_t": keys.stride(0),
            "sk_h": keys.stride(1), "sv_t": values.stride(0), "sv_h": values.stride(1)}


def one_pass(q, keys, values, page_table, positions, page_size: int, scale: float,
             window: int, out: torch.Tensor, launch: Launch, new: NewToken | None = None,
             act: Activation | None = None, pdl: bool = False) -> torch.Tensor:
    """The one-pass kernel into ``out``; ``launch.heads`` is cut to a power of
    two dividing the head count. With ``new``, q is before its rotary
    embedding and the step's own key and value are written and attended;
    with ``act``, that activation rides along."""
    b, h, d = q.shape
    heads = math.gcd(launch.heads, h)
    kernels.one_pass_kernel[(b, h // heads)](
        q, keys, values, page_table, positions, out,
        **_cache_args(q, keys, values), spt_b=page_table.stride(0), so_b=out.stride(0),
        so_h=out.stride(1), scale=scale, window=window,
        **_rotary_args(new, q), **_token_args(new, q), **_act_args(act, q, h // heads),
        GROUP=h // keys.shape[1], PS=page_size, D=d, BLOCK_D=_next_power_of_2(d),
        BLOCK_N=launch.block_n, HEADS=heads, STAGES=launch.stages, num_warps=launch.warps,
        PDL=pdl, **launch_options(pdl))
    return out


def _split_grid(length: int, max_splits: int) -> tuple[int, int]:
    """The split kernel's keys per program and programs per (row, head)
    for a bucket of ``length`` keys (``split_chunk``)."""
    chunk = split_chunk(length, max_splits)
    return chunk, -(-length // chunk)


def split_attention(q, keys, values, page_table, positions, page_size: int, scale: float,
                    window: int, out: torch.Tensor | None = None,
                    new: NewToken | None = None, act: Activation | None = None,
                    pdl: bool = False, prefetch: bool = False,
                    counters: torch.Tensor | None = None, max_splits: int = 64,
                    block: int = 32, warps: int = 2) -> torch.Tensor:
    """Flash-decoding: each (row, head) spread over programs of ``chunk``
    keys (``split_chunk``: at most ``max_splits`` programs; ``block`` keys
    an iteration, at most the chunk, in ``warps`` warps), then one
    combining pass (why: docs/performance.md). ``new`` and
    ``act`` as in ``one_pass``: the combining pass writes and adds the
    step's own key, and applies the activation. With ``counters`` (int32,
    at least ``[B * H]``, zero, and left zero) the last program of each
    (row, head) combines instead of a second kernel (``split_kernel``'s
    LAST_COMBINES)."""
    b, h, d = q.shape
    chunk, splits = _split_grid(page_table.shape[1] * page_size, max_splits)
    m = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty((b, h, values.shape[2]), dtype=out_dtype(q, new), device=q.device)
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < b * h):
        raise ValueError(f"split_attention: counters must be int32 with at least {b * h} entries")
    group = h // keys.shape[1]
    rotary = _rotary_args(new, q)
    combine = dict(out_ptr=out, so_b=out.stride(0), so_h=out.stride(1), **_token_args(new, q),
                   **_act_args(act, q, h), BLOCK_S=_next_power_of_2(splits))
    kernels.split_kernel[(b, h, splits)](
        q, keys, values, page_table, positions, m, l, acc,
        **_cache_args(q, keys, values), spt_b=page_table.stride(0), scale=scale, window=window,
        chunk=chunk, splits=splits, heads=h, **rotary,
        cnt_ptr=counters if counters is not None else m, **combine,
        GROUP=group, PS=page_size, D=d, BLOCK_D=_next_power_of_2(d), BLOCK_N=min(block, chunk),
        num_warps=warps, PDL=pdl, PREFETCH=pdl and prefetch, LAST_COMBINES=counters is not None,
        **launch_options(pdl))
    if counters is None:
        kernels.combine_kernel[(b, h)](
            m, l, acc, splits=splits, heads=h, q_ptr=q, k_ptr=keys, v_ptr=values,
            **_cache_args(q, keys, values), scale=scale, **rotary, **combine,
            D=d, BLOCK_D=_next_power_of_2(d), GROUP=group, num_warps=2, PDL=pdl,
            **launch_options(pdl))
    return out


def whole_attention(q, keys, values, page_table, positions, page_size: int, scale: float,
                    window: int, out: torch.Tensor, new: NewToken,
                    act: Activation | None = None, pdl: bool = False, prefetch: bool = False,
                    warps: int = 2) -> torch.Tensor:
    """The split kernel with one program per (row, head) over the whole
    bucket, in one block (``split_kernel``'s WHOLE;
    ``Dispatch.whole_rows``): with ``pdl`` and ``prefetch`` every key is
    read before the wait, and no pass combines. The block is held in
    registers: at least ``warps`` warps, and as many more as keep a
    thread's share of its keys to 64 values (as many of its values), at
    most 8 (256 keys of 64 in 8). ``new``, ``act`` as in
    ``split_attention``."""
    b, h, d = q.shape
    block = _next_power_of_2(page_table.shape[1] * page_size)
    warps = min(8, max(warps, block * _next_power_of_2(d) // 2048))
    kernels.split_kernel[(b, h, 1)](
        q, keys, values, page_table, positions, q, q, q,
        **_cache_args(q, keys, values), spt_b=page_table.stride(0), scale=scale, window=window,
        chunk=block, splits=1, heads=h, **_rotary_args(new, q), cnt_ptr=q,
        out_ptr=out, so_b=out.stride(0), so_h=out.stride(1), **_token_args(new, q),
        **_act_args(act, q, h), BLOCK_S=1, GROUP=h // keys.shape[1], PS=page_size, D=d,
        BLOCK_D=_next_power_of_2(d), BLOCK_N=block, num_warps=warps, PDL=pdl,
        PREFETCH=pdl and prefetch, LAST_COMBINES=False, WHOLE=True, **launch_options(pdl))
    return out


@attrs.frozen
class States:
    """A decode step's attention left as the split kernel's partial states,
    the step's own key among them (``split_states``): each (row, head)'s
    ``splits`` maxima ``m`` and sums ``l`` ``[B, H, S]`` and unnormalised
    outputs ``acc`` ``[B, H, S, D]``, float32. Its attention output is
    ``sum_s w_s acc_s / sum_s w_s l_s`` with ``w_s = exp(m_s - max m)``,
    rounded to ``dtype``."""
    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor
    dtype: torch.dtype

    def combined(self) -> torch.Tensor:
        """The attention output ``[B, H, D]`` in ``dtype`` (torch; what the
        output projection computes as it reads the states)."""
        w = torch.exp(self.m - self.m.amax(-1, keepdim=True))
        out = (w[..., None] * self.acc).sum(-2) / (w * self.l).sum(-1, keepdim=True)
        return out.to(self.dtype)


def split_states(q, keys, values, page_table, positions, page_size: int, scale: float,
                 window: int, new: NewToken, pdl: bool = False, prefetch: bool = False,
                 max_splits: int = 64, early: bool = False, block: int = 32,
                 warps: int = 2) -> States:
    """The split kernel with no combining pass (``split_kernel``'s OWN): the
    step's own key and value are written and joined to split 0's state, and
    the states are returned for the output projection to combine as it
    reads them (``skinny_gemm``'s STATES): one kernel boundary and one
    round of arrivals fewer than ``split_attention``. ``early`` (with
    ``pdl`` and ``prefetch``): the output projection may launch before the
    kernel waits (``KernelConfig.early_attention``). ``block``, ``warps``: as
    ``split_attention``'s."""
    b, h, d = q.shape
    chunk, splits = _split_grid(page_table.shape[1] * page_size, max_splits)
    ml = torch.empty((2, b, h, splits), dtype=torch.float32, device=q.device)
    acc = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    kernels.split_kernel[(b, h, splits)](
        q, keys, values, page_table, positions, ml[0], ml[1], acc,
        **_cache_args(q, keys, values), spt_b=page_table.stride(0), scale=scale, window=window,
        chunk=chunk, splits=splits, heads=h, **_rotary_args(new, q), cnt_ptr=ml,
        out_ptr=acc, so_b=0, so_h=0, **_token_args(new, q), **_act_args(None, q, h),
        BLOCK_S=_next_power_of_2(splits), GROUP=h // keys.shape[1], PS=page_size, D=d,
        BLOCK_D=_next_power_of_2(d), BLOCK_N=min(block, chunk), num_warps=warps, PDL=pdl,
        PREFETCH=pdl and prefetch, LAST_COMBINES=False, OWN=True,
        EARLY=early and pdl and prefetch, **launch_options(pdl))
    return States(ml[0], ml[1], acc, out_dtype(q, new))


def run(q, keys, values, page_table, positions, page_size: int, scale: float, window: int,
        dispatch: Dispatch, new: NewToken | None = None, out: torch.Tensor | None = None,
        act: Activation | None = None, pdl: bool = False,
        counters: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel ``dispatch`` picks for these shapes, into ``out`` ``[B, H,
    Dv]`` (a new one by default); ``pdl``: launched dependent on the kernel
    before (``cuda_backend.pdl``); ``counters``: the split kernel's last
    programs combine (``split_attention``), unless the bucket runs it whole
    (``whole_attention``: with ``new``, and the bucket within the dispatch's
    ``whole_rows`` and ``whole_keys``)."""
    b, h, d = q.shape
    if out is None:
        out = torch.empty((b, h, values.shape[2]), dtype=out_dtype(q, new), device=q.device)
    length = page_table.shape[1] * page_size
    # A bucket's shapes are fixed at capture, so is this choice.
    launch = dispatch.choose(b, h, length)
    if launch is None and new is not None and dispatch.whole(b, length):
        whole_attention(q, keys, values, page_table, positions, page_size, scale, window, out,
                        new, act, pdl, dispatch.prefetch, dispatch.split_warps)
    elif launch is None:
        split_attention(q, keys, values, page_table, positions, page_size, scale, window, out,
                        new, act, pdl, dispatch.prefetch, counters, dispatch.max_splits,
                        dispatch.split_block, dispatch.split_warps)
    else:
        one_pass(q, keys, values, page_table, positions, page_size, scale, window, out, launch,
                 new, act, pdl)
    return out


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                           scaling: float | None, window: int | None, *,
                           dispatch: Dispatch) -> torch.Tensor:
    """One query per row over its own pages, by the kernel ``dispatch``
    picks; returns ``[B, H, Dv]`` in q's dtype."""
    if keys.stride(2) != 1 or values.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("paged_decode_attention: the head dimension must be contiguous")
    scale = scaling if scaling is not None else q.shape[2] ** -0.5
    return _paged_decode(q, keys, values, page_table, positions, page_size, float(scale),
                         int(window) if window is not None else NO_WINDOW, dispatch.scalars())


# A custom op, so torch.compile treats the kernel as one opaque call (its fake
# gives the output's shape) instead of recompiling the Triton source itself.
# It takes the dispatch as integers (Dispatch.scalars): an op's arguments are
# tensors and scalars.
@torch.library.custom_op("bubblefree::paged_decode", mutates_args=())
def _paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  page_table: torch.Tensor, positions: torch.Tensor, page_size: int,
                  scale: float, window: int, dispatch: list[int]) -> torch.Tensor:
    return run(q, keys, values, page_table, positions, page_size, scale, window,
               Dispatch.from_scalars(dispatch))


@_paged_decode.register_fake
def _(q, keys, values, page_table, positions, page_size, scale, window, dispatch):
    return q.new_empty((q.shape[0], q.shape[1], values.shape[2]))
