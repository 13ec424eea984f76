"""Times the one-pass paged decode kernel's launch settings (BLOCK_N, warps)
on the GPU at the benchmark model's attention shape, so the defaults are
measured. Calls are launched from the host in a loop: a kernel shorter than
a launch (~20 us here) shows the launch, not itself; only the larger cases
(64 rows, 512 positions) measure the kernel. In-graph kernel times come from
``bench.profile_step``.

    python -m bench.attention_tune [--rows 1,32,64] [--contexts 128,1024]
"""

from __future__ import annotations

import argparse

import torch

from cuda_backend import paged_decode as pd


def time_kernel(rows: int, context: int, block_n: int, warps: int, heads: int = 32,
                dim: int = 64, ps: int = 16, iters: int = 200) -> float:
    pages = -(-context // ps) + 1
    total = rows * pages + 1
    keys = torch.randn(total * ps, heads, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    table = torch.randperm(total - 1, device="cuda")[:rows * pages].view(rows, pages)
    positions = torch.full((rows,), context, device="cuda")
    q = torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def launch():
        pd._kernel[(rows, heads)](
            q, keys, values, table, positions, out,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
            values.stride(0), values.stride(1), table.stride(0), out.stride(0), out.stride(1),
            dim ** -0.5, pd.NO_WINDOW, GROUP=1, PS=ps, D=dim, BLOCK_D=dim, BLOCK_N=block_n,
            num_warps=warps)
    for _ in range(3):
        launch()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        launch()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32,64")
    ap.add_argument("--contexts", default="128,1024")
    args = ap.parse_args()
    print("| rows | context | BLOCK_N | warps | us per call |")
    print("|---:|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            for bn in (32, 64, 128):
                for w in (2, 4, 8):
                    us = time_kernel(rows, ctx, bn, w)
                    print(f"| {rows} | {ctx} | {bn} | {w} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
