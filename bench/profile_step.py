"""Where a decode step's GPU time goes (moondream2's text-decoder shape).

Times the captured decode graph per batch bucket with CUDA events, and
prints the top kernels of one eager decode forward from torch.profiler, so
optimisation starts from a measurement rather than a guess.

    python -m bench.profile_step [--rows 1,8,32,64] [--context 128]
"""

from __future__ import annotations

import argparse

import torch
from transformers import PhiForCausalLM

from cuda_backend.backend import CudaBackend
from cuda_backend.tiny import phi15_config


def time_graph(be: CudaBackend, b: int, p: int, context: int, iters: int = 50) -> float:
    r, meta, ps = be._runner, be._runner.decode_meta, be.capacity.page_size
    pages = torch.arange(b * p, device=be.device).view(b, p) + 1
    meta[:b] = torch.arange(b, device=be.device)
    meta[b:2 * b] = context
    meta[2 * b:2 * b + b * p] = pages.view(-1)
    fn = (lambda: r.decode_forward(b, p))
    with torch.no_grad(), torch.cuda.stream(be._compute):
        for _ in range(3):
            be._decode_graphs.run((b, p), fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            be._decode_graphs.run((b, p), fn)
        end.record()
    torch.cuda.synchronize()
    assert context < p * ps
    return start.elapsed_time(end) / iters


def top_kernels(be: CudaBackend, b: int, p: int, n: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile
    r = be._runner
    with torch.no_grad(), torch.cuda.stream(be._compute):
        r.decode_forward(b, p)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r.decode_forward(b, p)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=n)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--kernels-at", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="also time the compiled decode step")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = PhiForCausalLM(phi15_config()).to(torch.bfloat16).eval()
    be = CudaBackend(model, page_size=16, num_pages=8192, max_rows=64, max_seqs=64,
                     max_prefill_tokens=2048, max_context=256)
    p = be._pages[0]
    print(f"page buckets {be._pages}, row buckets {be._rows}; using p={p}")
    for b in (int(x) for x in args.rows.split(",")):
        ms = time_graph(be, b, p, args.context)
        print(f"decode graph b={b:3d}: {ms:.3f} ms/step (GPU)", flush=True)
    print(top_kernels(be, args.kernels_at, p))
    if args.compile:
        del be
        torch.cuda.empty_cache()
        be = CudaBackend(model, page_size=16, num_pages=8192, max_rows=64, max_seqs=64,
                         max_prefill_tokens=2048, max_context=256, compile_decode=True)
        label = "compiled" if be._runner.decode_model is not model else "compile FAILED, eager"
        for b in (int(x) for x in args.rows.split(",")):
            ms = time_graph(be, b, p, args.context)
            print(f"{label} decode graph b={b:3d}: {ms:.3f} ms/step (GPU)", flush=True)


if __name__ == "__main__":
    main()
