"""Where a decode step's GPU time goes (moondream2's text-decoder shape, or
another of ``bench.speed``'s shapes with ``--model``).

Times the captured decode graph per batch bucket with CUDA events for each
way of running the step (transformers' forward or the fused step, eager or
compiled), and prints the top kernels of one step of the last, so
optimisation starts from a measurement rather than a guess.

    python -m bubblefree.bench.profile_step [--model phi|llama1b|qwen05b]
                                 [--rows 1,8,32,64] [--context 128] [--kernels-at 32]
                                 [--paths transformers,fused,fused+compile]
                                 [--attention default,split,separate,act-separate,1x16w1s1]
                                 [--gemm cublas,tiles.json] [--pdl 0,64]

``--attention`` builds the last path once per attention choice listed:
``default`` (``KernelConfig.measured``), ``split`` (the split kernel in every
bucket), ``separate`` (rotary and the KV write as compiled kernels before
attention, not inside it), ``act-separate`` (only Phi's MLP activation as a
kernel of its own), ``prefetch`` and ``no-prefetch`` (under dependent
launches, the split kernel's first keys read before it waits, or not:
``Dispatch.prefetch``), ``last-combines`` and ``no-last-combines`` (under
dependent launches, the split kernel's last programs combine in every
bucket, or in none: ``KernelConfig.last_combines``),
``splitsN`` (the split kernel's programs per (row, head) at most N:
``Dispatch.max_splits``), or a one-pass launch such as ``1x16w1s1`` (in
every bucket). ``--context`` sets the step's position, and the page bucket
the graphs are timed in is the one a sequence that long decodes in (a
moondream2 query, its 730-position image prefix and prompt, is about 760).
``--gemm`` builds it once more per GEMM choice listed, with the default
attention: ``cublas`` everywhere, or a table of our kernel's tiles (JSON,
from ``bench.gemm_tune --save``). Otherwise the step's GEMMs are the
defaults (``measured.MEASURED`` for this GPU).
``--pdl`` builds it once more per value listed of ``KernelConfig.pdl_rows``
(buckets of at most that many rows run ``pdl_step``'s dependent launches;
0: none), with the default attention and GEMMs.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import attrs
import torch

from bubblefree.bench.speed_setup import DECODE_PATHS as PATHS
from bubblefree.bench.speed_setup import SHAPES, build_model
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.graphs import bucket
from bubblefree.cuda_backend.kernel_config import KernelConfig, Launch, TileTable


def time_graph(be: CudaBackend, b: int, p: int, context: int, iters: int = 50) -> float:
    r, ps = be._runner, be.capacity.page_size
    row_slots, positions, table = r.meta_views(r.decode_meta, b, p)
    row_slots.copy_(torch.arange(b, device=be.device))
    positions.fill_(context)
    table.copy_(torch.arange(b * p, device=be.device).view(b, p) + 1)
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
    """The kernel table of one step (run outside the graph, same kernels)."""
    from torch.profiler import ProfilerActivity, profile
    r = be._runner
    with torch.no_grad(), torch.cuda.stream(be._compute):
        r.decode_forward(b, p)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r.decode_forward(b, p)
            torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.device_type.name == "CUDA")
    table = events.table(sort_by="cuda_time_total", row_limit=n)
    return f"{launches} kernels in one step at {b} rows\n{table}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="phi")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--kernels-at", type=int, default=32)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"of {', '.join(PATHS)}")
    ap.add_argument("--attention", default="",
                    help="attention choices for the last path: default, split, separate, "
                    "act-separate, prefetch, no-prefetch, last-combines, no-last-combines, splitsN, "
                    "torch-inputs "
                    "(a step's inputs gathered by torch's kernels), or launches")
    ap.add_argument("--gemm", default="", help="GEMM choices for the last path: cublas, or "
                    "JSON files of tiles")
    ap.add_argument("--pdl", default="", help="KernelConfig.pdl_rows values for the last path")
    ap.add_argument("--pdl-tiles", default="", help="with --pdl: the dependent step's GEMM tiles "
                    "(JSON, from bench.pdl_tune --save)")
    args = ap.parse_args(argv)
    model, label = build_model(False, shape=args.model)
    print(label, flush=True)
    rows = [int(x) for x in args.rows.split(",")]
    paths = args.paths.split(",")
    default = KernelConfig.measured("cuda", model.config)
    attention = {"default": default,
                 "split": attrs.evolve(default, dispatch=default.dispatch.forced(1 << 30)),
                 "separate": attrs.evolve(default, new_token=False),
                 "act-separate": attrs.evolve(default, mlp_act=False),
                 "last-combines": attrs.evolve(default, last_combines=64),
                 "no-last-combines": attrs.evolve(default, last_combines=0),
                 "torch-inputs": attrs.evolve(default, step_inputs=False),
                 **{name: attrs.evolve(default, dispatch=attrs.evolve(default.dispatch, prefetch=on))
                    for name, on in (("prefetch", True), ("no-prefetch", False))}}
    for x in args.attention.split(","):
        if x.startswith("splits") and x[6:].isdigit():
            attention[x] = attrs.evolve(default, dispatch=attrs.evolve(
                default.dispatch, max_splits=int(x[6:])))
        elif x and x not in attention:
            dispatch = default.dispatch.forced(split_below=0, launch=Launch.parse(x))
            attention[x] = attrs.evolve(default, dispatch=dispatch)
    gemms = {"default": default.tiles, "cublas": TileTable()}
    for x in args.gemm.split(","):
        if x and x not in gemms:
            with open(x) as f:
                gemms[x] = TileTable.read(json.load(f))
    last = [(paths[-1], x, "default", None) for x in args.attention.split(",") if x]
    last += [(paths[-1], "default", x, None) for x in args.gemm.split(",") if x]
    last += [(paths[-1], "default", "default", int(x)) for x in args.pdl.split(",") if x]
    runs = [(name, "default", "default", None) for name in paths[:-1]]
    runs = (list(dict.fromkeys(runs + last)) if last
            else runs + [(paths[-1], "default", "default", None)])
    results: dict[str, list[float]] = {}
    be = None
    if args.context < 1:
        ap.error(f"--context must be at least 1, not {args.context}")
    # Buckets as a server's: powers of two of pages from 256 positions.
    max_context = max(256, 1 << args.context.bit_length())
    for i, (path, chosen, gemm, pdl_rows) in enumerate(runs):
        kernels = attrs.evolve(attention[chosen], tiles=gemms[gemm])
        if pdl_rows is not None:
            kernels = attrs.evolve(kernels, pdl_rows=pdl_rows)
            if args.pdl_tiles:
                with open(args.pdl_tiles) as f:
                    kernels = attrs.evolve(kernels, pdl_tiles=TileTable.read(json.load(f)))
        choice = [f"attention {chosen}"] * (chosen != "default")
        choice += [f"GEMM {gemm.split('/')[-1]}"] * (gemm != "default")
        choice += [f"pdl_rows {pdl_rows}"] * (pdl_rows is not None)
        name = f"{path} [{', '.join(choice)}]" if choice else path
        t = time.perf_counter()
        be = CudaBackend(model, page_size=16, num_pages=8192, max_rows=64, max_seqs=64,
                         max_prefill_tokens=2048, max_context=max_context, kernels=kernels,
                         **PATHS[path])
        p = bucket(args.context // be.capacity.page_size + 1, be._pages)
        print(f"{name}: runs as '{be.decode_path}', built in {time.perf_counter() - t:.1f} s; "
              f"page bucket {p}", flush=True)
        results[name] = [time_graph(be, b, p, args.context) for b in rows]
        for b, ms in zip(rows, results[name]):
            print(f"  {name} decode graph b={b:3d}: {ms:.3f} ms/step (GPU)", flush=True)
        if i < len(runs) - 1:
            del be
            gc.collect()
            torch.cuda.empty_cache()
    print("\nGPU ms per captured decode step, context", args.context)
    print("| path | " + " | ".join(f"b={b}" for b in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, ms in results.items():
        print(f"| {name} | " + " | ".join(f"{x:.3f}" for x in ms) + " |")
    print(f"\nkernels of '{be.decode_path}':")
    print(top_kernels(be, args.kernels_at, p))


if __name__ == "__main__":
    main()
