"""What a grid-wide wait costs on this GPU, against what a kernel boundary
costs: the question a persistent layer kernel stands or falls on
(docs/performance.md, "A layer's second half as one persistent kernel").

One program a multiprocessor. A kernel whose programs wait for each
other ``rounds`` times, timed at two round counts: the difference over
the extra rounds is one wait's cost. Two ways of waiting:

- ``generation``: an arrival count and a generation; the last to arrive
  sets the count back to zero and moves the generation on, the others
  poll the generation (the removed kernel's way: three atomics on the
  last arrival's path);
- ``monotonic``: one count that only grows; each program adds one and
  polls until the count reaches the next multiple of the grid (one
  atomic a program, no reset).

Beside them, a chain of near-empty kernels of the same grid in one CUDA
graph, launched plainly and as dependent launches (``griddepcontrol``):
the kernel boundary a wait would replace.

    python -m bubblefree.bench.grid_wait [--rounds 200]
"""

from __future__ import annotations

import argparse

import torch

from bubblefree.bench.attention_tune import time_in_graph
from bubblefree.cuda_backend.pdl import launch_options, tl, triton

if triton is not None:

    @triton.jit
    def _load_acquire(ptr):
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _waits_kernel(sync_ptr, out_ptr, rounds, MONOTONIC: tl.constexpr):
        programs = tl.num_programs(0)
        for _ in range(rounds):
            if MONOTONIC:
                arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
                target = (arrived // programs + 1) * programs
                seen = _load_acquire(sync_ptr)
                while seen < target:
                    seen = _load_acquire(sync_ptr)
            else:
                gen = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
                arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
                if arrived == programs - 1:
                    tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
                    tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
                else:
                    seen = _load_acquire(sync_ptr + 1)
                    while seen == gen:
                        seen = _load_acquire(sync_ptr + 1)
        tl.store(out_ptr + tl.program_id(0), rounds)

    @triton.jit
    def _empty_kernel(out_ptr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(out_ptr + tl.program_id(0), 1)


def wait_us(programs: int, rounds: int, monotonic: bool) -> float:
    """One wait's µs: the kernel at ``rounds`` waits less the kernel at one,
    over ``rounds - 1``. The counters are checked after."""
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    out = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def run(n):
        return lambda: _waits_kernel[(programs,)](sync, out, n, MONOTONIC=monotonic, num_warps=4)
    one = time_in_graph(run(1), reps=1, replays=20)
    many = time_in_graph(run(rounds), reps=1, replays=20)
    if not monotonic and sync[0].item() != 0:
        raise RuntimeError(f"the generation wait left its count at {sync[0].item()}, not 0")
    if monotonic and sync[0].item() % programs:
        raise RuntimeError(f"the monotonic count {sync[0].item()} is not a multiple of {programs}")
    return (many - one) / (rounds - 1)


def boundary_us(programs: int, kernels: int, pdl: bool) -> float:
    """A near-empty kernel's µs in a chain of ``kernels`` of them."""
    out = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def chain():
        for _ in range(kernels):
            _empty_kernel[(programs,)](out, PDL=pdl, num_warps=4, **launch_options(pdl))
    return time_in_graph(chain, reps=1, replays=20) / kernels


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error(f"--rounds: at least 2 (one wait is the difference of two round counts), "
                 f"not {args.rounds}")
    if triton is None or not torch.cuda.is_available():
        ap.error("needs a CUDA GPU and Triton: the waits are timed on the device")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} multiprocessors; one program each, 4 warps")
    print("| what | µs each |\n|---|---:|")
    for name, monotonic in (("grid-wide wait, count and generation", False),
                            ("grid-wide wait, a count that only grows", True)):
        print(f"| {name} | {wait_us(sms, args.rounds, monotonic):.2f} |")
    for name, pdl in (("near-empty kernel in a chain, launched plainly", False),
                      ("near-empty kernel in a chain, dependent launches", True)):
        print(f"| {name} | {boundary_us(sms, args.rounds, pdl):.2f} |")


if __name__ == "__main__":
    main()
