"""``cut_sample``'s kernels run by Triton's interpreter on the CPU, against
torch's cut path (``sampling.sample_tokens``, ``Draw.CUT``) on the same
inputs. Run as its own process (``python -m tests.cut_interpreted``;
``tests/test_cut_sample.py`` does): the interpreter must be chosen before
Triton is imported, and libdevice's functions, which it cannot call, are
numpy's here (the kernels' logarithm and exponential, so the noise
matches torch's to float32 rounding, not bit for bit).

Exits 0 with a summary line when every step's tokens, ``last_token`` and
flags are as torch's path and the rule say; otherwise with the first
difference.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import attrs  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402
from triton.runtime.interpreter import TensorHandle  # noqa: E402


def _numpy(fn):
    def call(x, _semantic=None):
        data = fn(x.handle.data).astype(x.handle.data.dtype)
        return tl.tensor(TensorHandle(data, x.handle.dtype), x.type)
    return call


libdevice.exp, libdevice.log = _numpy(np.exp), _numpy(np.log)

from bubblefree.core.values import SamplingParams, StepRow  # noqa: E402
from bubblefree.cuda_backend import cut_sample  # noqa: E402
from bubblefree.cuda_backend.sampling import (PARTS, Draw, pack_sampling,  # noqa: E402
                                              sample_inputs, vocab_hash)

TEMPERATURES = (0.0, 0.7, 1.3, 1e-5, 30.0, 2.0)
CUTS = (dict(), dict(top_p=0.9), dict(top_k=50), dict(min_p=0.05),
        dict(top_k=20, top_p=0.5, min_p=0.01), dict(top_p=0.3), dict(top_p=0.97),
        dict(top_k=3000, top_p=0.99), dict(min_p=1e-5), dict(top_k=10**6, top_p=0.999))


def step(v: int, n: int, b: int, seed: int, spread: float):
    """Logits ``[b + 1, V]`` (row 0's best tied between two ids), a table
    of three masks, and ``pack_sampling``'s inputs for ``n`` rows in
    bucket ``b``: every temperature, cut and mask in turn, 64-bit seeds."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b + 1, v, generator=g) * spread
    logits[0, v // 2] = logits[0, v - 1] = logits[0].max() + 1
    table = torch.rand(3, v, generator=g) > 0.4
    table[0] = True
    rows = tuple(StepRow(seq_id=i, row_slot=2 * i + 1, tokens=(), position=31 * i + seed, pages=(),
                         sampling=SamplingParams(
                             temperature=TEMPERATURES[(i + seed) % len(TEMPERATURES)],
                             seed=(2**63 + 7919 * i + seed) % 2**64,
                             **CUTS[(i + 3 * seed) % len(CUTS)]))
                 for i in range(n))
    packed = np.zeros(PARTS * b, dtype=np.int64)
    kind = pack_sampling(packed, rows, tuple([None, 1, 2][(i + seed) % 3] for i in range(n)), b,
                         scratch_row=2 * b + 1)
    return logits, table, torch.from_numpy(packed), kind


def check(v: int, n: int, b: int, seed: int, spread: float) -> list[int]:
    logits, table, inputs, kind = step(v, n, b, seed, spread)
    row_slots = inputs[:b].tolist()
    _, want = sample_inputs(inputs, logits, table, vocab_hash(v, torch.device("cpu")), b, Draw.CUT)
    sampled = torch.full((b,), -1, dtype=torch.long)
    last = torch.full((2 * b + 2,), -1, dtype=torch.long)
    flags = torch.ones(2 * b + 2, dtype=torch.bool)
    cut_sample.CutSampler(v)(logits, table, inputs, b, sampled, last, flags)
    where = f"V={v} n={n} b={b} seed={seed} spread={spread} ({kind})"
    got = sampled.tolist()
    if got != want.tolist():
        sys.exit(f"{where}: tokens {got}, torch's cut path {want.tolist()}")
    # Padded rows (greedy, unmasked) all write the scratch row's slot: any of their tokens.
    if [last[s].item() for s in row_slots[:n]] != got[:n] or flags[row_slots].any() \
            or (n < b and last[row_slots[-1]].item() not in got[n:]):
        sys.exit(f"{where}: last_token or the flags not written at the rows' slots")
    untouched = [s for s in range(2 * b + 2) if s not in row_slots]
    if (last[untouched] != -1).any() or not flags[untouched].all():
        sys.exit(f"{where}: last_token or the flags written beside the rows' slots")
    masks = inputs[b:2 * b].tolist()
    if not all(table[m, t] for m, t in zip(masks, got)):
        sys.exit(f"{where}: a token outside its mask")
    return got


def alone(v: int, n: int, b: int, seed: int, spread: float, together: list[int]) -> None:
    """I8: each drawn row of the step, alone in a bucket of one, draws its token."""
    logits, table, inputs, _ = step(v, n, b, seed, spread)
    for i in range(n):
        one = torch.tensor([inputs[j * b + i].item() for j in range(PARTS)])
        sampled = torch.full((1,), -1, dtype=torch.long)
        last = torch.full((2 * b + 2,), -1, dtype=torch.long)
        cut_sample.CutSampler(v)(logits[i:i + 1].contiguous(), table, one, 1, sampled, last)
        if sampled.item() != together[i]:
            sys.exit(f"V={v} seed={seed}: row {i} alone drew {sampled.item()}, "
                     f"{together[i]} beside {n - 1} others")


def wide(v: int, logits_row: torch.Tensor, sampling: SamplingParams, seeds: int) -> None:
    """One row of ``logits_row`` drawn with ``sampling`` at ``seeds`` seeds,
    a bucket of one each: the tokens torch's cut path draws."""
    table = torch.ones(1, v, dtype=torch.bool)
    salt = vocab_hash(v, torch.device("cpu"))
    for seed in range(seeds):
        row = StepRow(seq_id=0, row_slot=0, tokens=(), position=seed, pages=(),
                      sampling=attrs.evolve(sampling, seed=seed))
        packed = np.zeros(PARTS, dtype=np.int64)
        pack_sampling(packed, (row,), (None,), 1, scratch_row=1)
        inputs = torch.from_numpy(packed)
        _, want = sample_inputs(inputs, logits_row[None], table, salt, 1, Draw.CUT)
        sampled, last = torch.full((1,), -1, dtype=torch.long), torch.zeros(2, dtype=torch.long)
        cut_sample.CutSampler(v)(logits_row[None].contiguous(), table, inputs, 1, sampled, last)
        if sampled.item() != want.item():
            sys.exit(f"{sampling}: drew {sampled.item()}, torch's cut path {want.item()}")


def across_blocks() -> None:
    """Rows whose cuts reach past the kernel's first block of ranks."""
    v, block = 5000, cut_sample.BLOCK
    # A flat row: top_p 0.6 keeps about 3,000 ranks, so the mass before a
    # rank carries from one block into the next.
    flat = torch.randn(v, generator=torch.Generator().manual_seed(5)) * 0.01
    wide(v, flat, SamplingParams(temperature=1.0, top_p=0.6), 12)
    # A top_k denominator whose tail, past the first block, is about 1.4%
    # of it: top_p sits between the best's share of the sum with and
    # without that tail, so whether the second rank (as likely as the
    # first) is kept, and drawn half the time, turns on the whole sum.
    head = torch.zeros(v)
    head[block:] = -4.6
    whole, tail = head.exp().sum().item(), head[block:].exp().sum().item()
    top_p = (1 / whole + 1 / (whole - tail)) / 2
    wide(v, head, SamplingParams(temperature=1.0, top_k=v - 1, top_p=top_p), 12)


def through_a_backend() -> None:
    """The backend's cut steps through the kernels (``CudaBackend._cut``, set
    here as a GPU's backend sets it): the tokens torch's path generates,
    masked rows and a moved row slot included."""
    from bubblefree.cuda_backend.backend import CudaBackend
    from bubblefree.cuda_backend.drive import generate
    from bubblefree.cuda_backend.tiny import tiny_model
    model = tiny_model("llama", device="cpu", seed=4)
    prompts = [[5, 6, 7], [8, 9], [10]]
    sampling = [SamplingParams(temperature=t, seed=s, **cut) for t, s, cut in
                ((1.3, 4, dict(top_p=0.8)), (0.0, 5, dict(top_k=3)), (0.9, 6, dict(min_p=0.2)))]
    runs = []
    for kernels in (False, True):
        be = CudaBackend(model, page_size=4, num_pages=64, max_rows=4, max_seqs=8,
                         max_prefill_tokens=64, min_graph_context=8)
        if kernels:
            be._cut = cut_sample.CutSampler(be.vocab_size)
        mask = be.register_mask(frozenset(range(40, 60)))
        runs.append([generate(be, prompts, 6, sampling=sampling, mask_ids=[None, mask, None],
                              row_slots=slots) for slots in ([0, 1, 2], [3, 0, 1])])
    if runs[0] != runs[1]:
        sys.exit(f"through a backend: the kernels generated {runs[1]}, torch's path {runs[0]}")
    if not all(40 <= t < 60 for t in runs[1][0][1]):
        sys.exit("through a backend: a masked row's token outside its mask")


def main() -> None:
    steps = rows = 0
    for v in (64, 3000, 5000):
        for seed in range(4):
            for n, b in ((1, 1), (5, 8), (8, 8)):
                for spread in (0.5, 3.0):
                    check(v, n, b, seed, spread)
                    steps, rows = steps + 1, rows + n
            alone(v, 6, 8, seed, 3.0, check(v, 6, 8, seed, 3.0))
    across_blocks()
    through_a_backend()
    print(f"cut kernels: {steps} steps, {rows} rows, as torch's cut path")


if __name__ == "__main__":
    main()
