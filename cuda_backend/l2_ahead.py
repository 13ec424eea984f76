"""Weights asked into L2 ahead of the GEMM that reads them
(``KernelConfig.l2_ahead``), in the decode step whose kernels are all ours
(``pdl_step``).

At one row a step's memory is busy only while a large GEMM streams its
weights. Between them (a small projection's start and tail, the norms,
attention) it idles, and the next GEMM then starts cold: its first reads
wait the full latency of memory, and a 2 MB projection never reaches the
bandwidth at all. Here every GEMM of the step, once its programs have read
and stored their own part, asks L2 for the weights that lie ``distance``
bytes further along the step (PTX ``prefetch.global.L2``: a hint with no
result, nothing waits for it). Memory then keeps streaming through the
gaps, and the GEMMs that follow read from L2.

The weights in the order the step reads them are one cyclic stream (the
head's successor is the first layer's first GEMM, for the next step).
GEMM j, whose own weights lie at ``[a, b)`` of it, asks for
``[max(a + distance, b), b + distance)``: each byte once, by the GEMM
``distance`` bytes before it, and never its own (a GEMM larger than the
distance streams at the bandwidth by itself). So ``distance`` must stay
well under L2 (50 MB on Hopper), or what was asked for is evicted before
it is read.

A GEMM of several waves (the head) leaves the asking to its last
``participants`` programs, those that end last; each takes an equal share
of the lines. ``plan`` holds the window as up to ``RANGES`` pieces
(address, bytes) in one int64 tensor, built once per model.
"""

from __future__ import annotations

import torch

from bubblefree.cuda_backend.pdl import tl, triton

LINE = 128  # bytes an L2 line holds: one request per line
RANGES = 4  # pieces of a window a plan holds; a window over more is cut


def windows(sizes: list[int], distance: int) -> list[list[tuple[int, int, int]]]:
    """For GEMMs whose weights take ``sizes`` bytes, in the order the step
    reads them: each GEMM's window as ``(gemm, offset, bytes)`` pieces of
    the weights it asks for, in stream order (at most ``RANGES``)."""
    if not sizes or any(s <= 0 for s in sizes) or distance < 0:
        raise ValueError(f"l2_ahead: sizes {sizes} must be positive and some, distance "
                         f"{distance} >= 0")
    total = sum(sizes)
    # One shift for all, so each byte is asked once; short of the stream's
    # length less the largest GEMM, so none reaches its own next turn.
    distance = min(distance, total - max(sizes))
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    out = []
    for a, size in zip(starts, sizes):
        lo, hi = max(a + distance, a + size), a + size + distance
        pieces = []
        while lo < hi and len(pieces) < RANGES:
            pos = lo % total
            j = max(i for i, s in enumerate(starts) if s <= pos)
            take = min(hi - lo, starts[j] + sizes[j] - pos)
            pieces.append((j, pos - starts[j], take))
            lo += take
        out.append(pieces)
    return out


def plans(weights: list[torch.Tensor], distance: int) -> list[torch.Tensor | None]:
    """Each GEMM's window as the kernel reads it, for GEMMs over
    ``weights`` (contiguous, in the order the step reads them): int64
    ``[RANGES, 2]`` of (address, bytes), or None where it asks for nothing."""
    sizes = [w.numel() * w.element_size() for w in weights]
    out = []
    for pieces in windows(sizes, distance):
        if not pieces:
            out.append(None)
            continue
        rows = [(weights[j].data_ptr() + off, n) for j, off, n in pieces]
        rows += [(0, 0)] * (RANGES - len(rows))
        out.append(torch.tensor(rows, dtype=torch.int64, device=weights[0].device))
    return out


if triton is not None:
    _RANGES, _LINE = tl.constexpr(RANGES), tl.constexpr(LINE)  # as a kernel may read them

    @triton.jit
    def _l2(ptrs):
        # A hint: no result, and nothing later waits on it.
        return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def ask(plan_ptr, program, programs, participants, LINES: tl.constexpr):
        """Program ``program`` of ``programs`` asks for its share of the
        plan's lines; only the last ``participants`` programs take part."""
        q = program - (programs - tl.minimum(programs, participants))
        if q >= 0:
            p = tl.minimum(programs, participants)
            total = 0
            for r in tl.static_range(_RANGES):
                total += tl.cdiv(tl.load(plan_ptr + 2 * r + 1), _LINE)
            lo = q * total // p
            hi = (q + 1) * total // p
            base = 0
            for r in tl.static_range(_RANGES):
                addr = tl.load(plan_ptr + 2 * r)
                lines = tl.cdiv(tl.load(plan_ptr + 2 * r + 1), _LINE)
                first = tl.maximum(lo - base, 0)
                last = tl.minimum(hi - base, lines)
                for i in range(first, last, LINES):
                    idx = tl.minimum(i + tl.arange(0, LINES), last - 1)  # the tail repeats a line
                    _l2((addr + idx.to(tl.int64) * _LINE).to(tl.pointer_type(tl.int8)))
                base += lines
else:  # pragma: no cover - exercised where Triton is absent
    ask = None
