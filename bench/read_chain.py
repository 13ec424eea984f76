"""The least a chain of kernels can take when each only reads its bytes:
how far the step's structure, not its arithmetic, sets its time
(docs/performance.md, "A step's chain of kernels, reading only").

A decode step at one row is a chain of kernels, each reading its weights
and waiting for its predecessor's few kilobytes of results. Here each
kernel of a model shape's step is replaced by one that reads the same
bytes, sums them, and adds the sum to what its predecessor wrote: no
arithmetic to speak of, the same chain of dependencies, the same bytes
(each kernel its own, so L2 holds none of them from one replay to the
next). Five ways of placing the reads, each kernel launched dependent on
the one before (``cuda_backend.pdl``):

- ``after``: wait for the predecessor, let the next kernel launch, then
  read (a kernel that reads nothing before its wait);
- ``before``: read, then wait and let the next launch (every byte asked for
  before the wait: the most a kernel can take ahead alone);
- ``release``: let the next launch, read, then wait (every kernel of the
  chain may be placed and reading at once, as far as the multiprocessors
  hold them: reading as a single kernel would);
- ``hold`` and ``hold-release``: as ``before`` and ``release``, but each
  program's share is one load kept in registers across the wait and summed
  only with its predecessor's value after it, as a GEMM holding its
  weights must (a kernel ahead occupies what it holds, so how far ahead
  the chain reads is bounded by the registers, as a real one's would be).

Each kernel's launch (programs, words a load, warps) is the fastest of a
grid for its size and mode, timed in a chain of its like. Then each
shape's step: its layers' kernels as the step has them, the same layers
with one kernel a layer, and the head and greedy sampling after them. Set
against the step's measured time, the difference is what the kernels'
arithmetic, their tiles and the step's other work cost beyond reading.

    python -m bubblefree.bench.read_chain [--models qwen05b,llama1b,phi] [--context 128]
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import torch

from bubblefree.bench.attention_tune import L2_BYTES, time_in_graph
from bubblefree.bench.pdl_tune import gemms
from bubblefree.bench.speed_setup import SHAPES, read_bandwidth
from bubblefree.cuda_backend import pdl
from bubblefree.cuda_backend.pdl import launch_options, tl, triton

MODES = ("after", "before", "release", "hold", "hold-release")
HELD = {"hold", "hold-release"}  # modes whose share is one load, kept until the wait
WORD = 4  # bytes a loaded element (int32)
ALIGN = 16  # words: each kernel's share starts and ends on 64 bytes
NORM_SLICES = 8  # float32 sums of the residual stream a norm reads a row


@dataclass(frozen=True)
class Kernel:
    """One kernel of a step's chain: what it stands for and the bytes it reads."""

    name: str
    nbytes: int

    @property
    def words(self) -> int:
        return max(ALIGN, -(-self.nbytes // (WORD * ALIGN)) * ALIGN)


def layer(shape: str, context: int) -> list[Kernel]:
    """One layer's kernels at one row, in the order the dependent-launch step
    runs them: the norms read the row's slices of sums, the attention kernel
    its keys and values, each GEMM its weights."""
    cfg = SHAPES[shape]["config"]()
    d = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    norm = Kernel("norm", d * 4 * NORM_SLICES)
    attention = Kernel("attention", kv * hd * 2 * 2 * context)
    g = {name: Kernel(name, k * n * 2) for name, (k, n, *_rest) in gemms(shape).items()}
    if cfg.model_type == "phi":
        return [norm, g["q,k,v,fc1"], attention, g["dense+fc2"]]
    return [norm, g["q,k,v"], attention, g["o"], norm, g["gate,up"], g["down"]]


def step(shape: str, context: int, one_a_layer: bool = False) -> list[Kernel]:
    """A step's chain: every layer, then the head and greedy sampling over
    its float32 logits. ``one_a_layer``: each layer's bytes in one kernel."""
    cfg = SHAPES[shape]["config"]()
    k, n, *_rest = gemms(shape)["head"]
    ks = layer(shape, context)
    if one_a_layer:
        ks = [Kernel("layer", sum(x.nbytes for x in ks))]
    return ks * cfg.num_hidden_layers + [Kernel("head", k * n * 2), Kernel("greedy", n * 4)]


@dataclass(frozen=True)
class Launch:
    """How a read kernel is launched: programs (at most; 0: as many as
    shares of one load each, the held modes' launch), words a load, warps."""

    programs: int
    block: int
    warps: int

    def __str__(self) -> str:
        return f"{self.programs or '*'}p{self.block}b{self.warps}w"

    def grid(self, words: int) -> tuple[int, int]:
        """(programs, words a program): every program a share of whole
        ALIGN-word groups, none empty; one load's worth where programs is 0."""
        if not self.programs:
            return -(-words // self.block), self.block
        groups = words // ALIGN
        programs = min(self.programs, groups)
        share = -(-groups // programs) * ALIGN
        return -(-words // share), share


SUMMED = [Launch(p, b, w) for p, b, w in itertools.product((132, 264, 528, 1056), (1024, 4096), (4, 8))]
HOLDING = [Launch(0, b, w) for b, w in itertools.product((512, 1024, 2048, 4096, 8192), (4, 8))]


def launches(mode: str) -> list[Launch]:
    """The launches timed for a mode: a held mode's share is one load."""
    return HOLDING if mode in HELD else SUMMED


if triton is not None:

    @triton.jit
    def _read_kernel(w_ptr, words, share, a_in, a_out, BLOCK: tl.constexpr, MODE: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        start = pid.to(tl.int64) * share
        if MODE == 0:
            pdl.enter(True)
        if MODE == 2 or MODE == 4:
            pdl.release(True)
        if MODE <= 2:  # summed as read: nothing held across the wait
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for i in range(0, share, BLOCK):
                at = start + i + offs
                acc += tl.load(w_ptr + at, mask=(i + offs < share) & (at < words), other=0)
            if MODE == 1:
                pdl.enter(True)
            if MODE == 2:
                pdl.wait(True)
            total = tl.sum(acc, axis=0) + tl.load(a_in + pid)
        else:  # one load held in registers; the sum needs the predecessor's value
            held = tl.load(w_ptr + start + offs, mask=start + offs < words, other=0)
            if MODE == 3:
                pdl.enter(True)
            if MODE == 4:
                pdl.wait(True)
            total = tl.sum(held * ((tl.load(a_in + pid) & 1) + 1), axis=0)
        tl.store(a_out + pid, total)


def launch_chain(buffer: torch.Tensor, kernels: list[Kernel], hows: list[Launch], mode: str,
                 carry: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Each kernel reads its own words of ``buffer`` (in order, one after
    another) and combines its sums with what the one before wrote
    (``carry``'s two vectors in turn)."""
    at = 0
    for i, (kernel, how) in enumerate(zip(kernels, hows)):
        programs, share = how.grid(kernel.words)
        words = buffer[at:at + kernel.words]
        _read_kernel[(programs,)](words, kernel.words, share, carry[i % 2], carry[1 - i % 2],
                                  BLOCK=how.block, MODE=MODES.index(mode), num_warps=how.warps,
                                  **launch_options(True))
        at += kernel.words


def carried(kernels: list[Kernel], hows: list[Launch]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two vectors a chain's kernels hand on, as wide as its widest grid."""
    width = max(how.grid(k.words)[0] for k, how in zip(kernels, hows))
    return (torch.zeros(width, dtype=torch.int32, device="cuda"),
            torch.zeros(width, dtype=torch.int32, device="cuda"))


def chain_us(kernels: list[Kernel], hows: list[Launch], mode: str) -> float:
    """µs for the whole chain, replayed from one CUDA graph."""
    buffer = torch.empty(sum(k.words for k in kernels), dtype=torch.int32, device="cuda")
    buffer.random_(-1000, 1000)
    carry = carried(kernels, hows)
    us = time_in_graph(lambda: launch_chain(buffer, kernels, hows, mode, carry), reps=1,
                       replays=20)
    del buffer
    return us


def check(mode: str) -> None:
    """A short chain's results against torch's: the kernels read every word
    they stand for, once, and each combines them with its predecessor's."""
    kernels = [Kernel("a", 4 << 20), Kernel("b", 1000), Kernel("c", 3 << 20)]
    hows = ([Launch(0, 1024, 4), Launch(0, 4096, 8), Launch(0, 512, 8)] if mode in HELD else
            [Launch(132, 1024, 4), Launch(528, 4096, 8), Launch(1056, 1024, 8)])
    buffer = torch.randint(-1000, 1000, (sum(k.words for k in kernels),), dtype=torch.int32,
                           device="cuda")
    carry = carried(kernels, hows)
    launch_chain(buffer, kernels, hows, mode, carry)
    want = [torch.zeros_like(carry[0], dtype=torch.int64) for _ in range(2)]
    at = 0
    for i, (kernel, how) in enumerate(zip(kernels, hows)):
        programs, share = how.grid(kernel.words)
        words = torch.zeros(programs * share, dtype=torch.int64, device="cuda")
        words[:kernel.words] = buffer[at:at + kernel.words]
        shares, before = words.view(programs, share), want[i % 2][:programs]
        if mode in HELD:
            want[1 - i % 2][:programs] = (shares * ((before & 1) + 1)[:, None]).sum(dim=1)
        else:
            want[1 - i % 2][:programs] = shares.sum(dim=1) + before
        at += kernel.words
    last = len(kernels) % 2
    if not torch.equal(carry[last].long(), want[last]):
        raise RuntimeError(f"the read chain ({mode}) summed other words than it stands for")


def fastest(kernel: Kernel, mode: str, cache: dict) -> tuple[Launch, float]:
    """The fastest launch for a kernel of this size and mode, and its µs a
    kernel, timed in a chain of its like whose bytes exceed L2 twice."""
    key = (kernel.nbytes, mode)
    if key not in cache:
        copies = min(400, max(16, -(-2 * L2_BYTES // kernel.nbytes)))
        timed = {how: chain_us([kernel] * copies, [how] * copies, mode) / copies
                 for how in launches(mode)}
        best = min(timed, key=timed.get)
        cache[key] = (best, timed[best])
    return cache[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen05b,llama1b,phi")
    ap.add_argument("--context", type=int, default=128)
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in SHAPES:
            ap.error(f"--models: {m!r} is not a shape; the shapes are {', '.join(SHAPES)}")
    if args.context < 1:
        ap.error(f"--context: at least 1 key, not {args.context}")
    if triton is None or not pdl.supported("cuda"):
        ap.error("needs a Hopper-class CUDA GPU and Triton: the chains are timed there, "
                 "launched dependent on each other")
    for mode in MODES:
        check(mode)
    bandwidth, how = read_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name(0)}; read bandwidth {bandwidth / 1e12:.2f} TB/s ({how}); "
          f"context {args.context}, one row")
    cache: dict = {}
    print_kernels(models, args.context, cache)
    for m in models:
        print_step(m, args.context, bandwidth, cache)


def print_kernels(models: list[str], context: int, cache: dict) -> None:
    """Each size of kernel the shapes' steps have, alone in a chain of its
    like, in every mode: µs a kernel at its fastest launch."""
    sizes = sorted({k for m in models for k in step(m, context) + step(m, context, True)},
                   key=lambda k: k.nbytes)
    print("\nOne kernel in a chain of its like (µs a kernel; fastest launch):\n")
    print("| kernel | MB | " + " | ".join(f"{mode} µs | launch | TB/s" for mode in MODES) + " |")
    print("|---|---:|" + "---:|---|---:|" * len(MODES))
    for kernel in sizes:
        cells = []
        for mode in MODES:
            how, us = fastest(kernel, mode, cache)
            cells.append(f"{us:.2f} | {how} | {kernel.nbytes / us / 1e6:.2f}")
        print(f"| {kernel.name} | {kernel.nbytes / 1e6:.3f} | " + " | ".join(cells) + " |")


def print_step(shape: str, context: int, bandwidth: float, cache: dict) -> None:
    """A shape's step as a chain, its kernels as the step has them and one
    kernel a layer, in every mode: µs a layer (the layers alone) and ms a
    step (with the head and greedy sampling)."""
    layers = SHAPES[shape]["config"]().num_hidden_layers
    total = sum(k.nbytes for k in step(shape, context))
    print(f"\n{SHAPES[shape]['label']}: {total / 1e9:.3f} GB a step, read floor "
          f"{total / bandwidth * 1e3:.3f} ms\n")
    print("| chain | " + " | ".join(f"{mode} µs a layer | {mode} ms a step" for mode in MODES)
          + " |")
    print("|---|" + "---:|---:|" * len(MODES))
    for name, whole in (("the step's kernels", False), ("one kernel a layer", True)):
        ks = step(shape, context, whole)
        per_layer = (len(ks) - 2) // layers
        cells = []
        for mode in MODES:
            hows = [fastest(k, mode, cache)[0] for k in ks]
            step_us = chain_us(ks, hows, mode)
            layer_us = chain_us(ks[:per_layer] * layers, hows[:per_layer] * layers, mode)
            cells.append(f"{layer_us / layers:.2f} | {step_us / 1e3:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
