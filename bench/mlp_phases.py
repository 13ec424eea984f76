"""Where the persistent second half of a layer (``layer_mlp``) spends its
time, at a model shape's sizes and one decode row.

Each way of launching it runs once a layer over that many layers' own
random weights (so they stream from memory, as in a step, not from L2),
captured in one CUDA graph; the table gives the GPU microseconds a layer
and how far its sums are from the torch reference. Ways: the three
phases as kernels of their own, each phase alone, the persistent kernel
(its waits polling with atomics or with loads; 4 or 8 warps), the
persistent kernel on one layer's weights (L2-resident: what is left is
latency and the waits), and the waits alone (a shape of one column a
program, whose phases do next to nothing).

    python -m bubblefree.bench.mlp_phases [--model qwen05b,llama1b] [--rows 1]
"""

from __future__ import annotations

import argparse

import torch

from bubblefree.bench.speed_setup import SHAPES
from bubblefree.cuda_backend import layer_mlp

# (name, launch keywords, layers of weights: None = the model's, 1 = one)
WAYS = (
    ("three kernels", dict(persistent=False), None),
    ("phase A alone (o, residual)", dict(persistent=False, phases=(0,)), None),
    ("phase B alone (norm, gate and up)", dict(persistent=False, phases=(1,)), None),
    ("phase C alone (down)", dict(persistent=False, phases=(2,)), None),
    ("persistent, atomic polls", dict(persistent=True), None),
    ("persistent, load polls", dict(persistent=True, load_poll=True), None),
    ("persistent, load polls, 8 warps", dict(persistent=True, load_poll=True, warps=8), None),
    ("persistent, load polls, 4 stages", dict(persistent=True, load_poll=True, stages=4), None),
    ("persistent, load polls, one layer's weights", dict(persistent=True, load_poll=True), 1),
)


def layer_weights(n: int, ko: int, inter: int, layers: int, seed: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return [dict(w_o=r(n, ko, scale=ko ** -0.5), b_o=None, norm_w=r(n), eps=1e-6,
                 w_gu=r(2 * inter, n, scale=n ** -0.5), b_gu=None,
                 w_down=r(n, inter, scale=inter ** -0.5), b_down=None) for _ in range(layers)]


def time_way(x, a, ws: list[dict], kw: dict, programs: int, replays: int = 20) -> tuple[float, float]:
    """(us a layer, the largest difference of a layer's sums from torch's)."""
    sync = layer_mlp.new_sync("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = [layer_mlp.launch(x, a, **w, sync=sync, programs=programs, pdl=False, **kw) for w in ws]
        torch.cuda.synchronize()
        err = 0.0
        if "phases" not in kw:
            for w, (h1, sums) in zip(ws, outs):
                want_h1, want = layer_mlp.torch_mlp_block(x, a, **w)
                err = max(err, (sums - want).abs().max().item(), (h1.float() - want_h1.float()).abs().max().item())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for w in ws:
                layer_mlp.launch(x, a, **w, sync=sync, programs=programs, pdl=False, **kw)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / len(ws), err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen05b,llama1b")
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    for name in args.model.split(","):
        cfg = SHAPES[name]["config"]()
        n, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        ko = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or n // cfg.num_attention_heads)
        mb = 2 * (n * ko + 2 * inter * n + n * inter) / 1e6
        print(f"\n{name}: hidden {n}, intermediate {inter}, {layers} layers, {mb:.1f} MB of weights a "
              f"layer, {args.rows} rows, {programs} programs")
        ws = layer_weights(n, ko, inter, layers, seed=0)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(args.rows, n, generator=g, device="cuda").to(torch.bfloat16)
        a = torch.randn(args.rows, ko, generator=g, device="cuda").to(torch.bfloat16)
        print("| way | us a layer | GB/s | largest difference from torch |\n|---|---:|---:|---:|")
        for way, kw, keep in WAYS:
            try:
                us, err = time_way(x, a, ws[:keep] if keep else ws, kw, programs)
            except Exception as e:  # noqa: BLE001 - a way that fails is a row, not the end
                print(f"| {way} | — | — | {type(e).__name__}: {str(e)[:120]} |")
                continue
            gbs = f"{mb * 1e3 / us:,.0f}" if "phases" not in kw else "—"
            print(f"| {way} | {us:.1f} | {gbs} | {err:.2g} |")
        # The waits alone: one column a program, so each phase is a few loads.
        tiny = layer_weights(programs, 16, programs, layers, seed=2)
        xt = torch.randn(args.rows, programs, generator=g, device="cuda").to(torch.bfloat16)
        at = torch.randn(args.rows, 16, generator=g, device="cuda").to(torch.bfloat16)
        for way, kw in (("waits alone, atomic polls", dict(persistent=True)),
                        ("waits alone, load polls", dict(persistent=True, load_poll=True)),
                        ("no waits: three near-empty kernels", dict(persistent=False))):
            us, err = time_way(xt, at, tiny, kw, programs)
            print(f"| {way} | {us:.1f} | — | {err:.2g} |")


if __name__ == "__main__":
    main()
