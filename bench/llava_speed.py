"""A transformers LLaVA served by bubblefree against the same model's ``generate``.

    python -m bubblefree.bench.llava_speed [--streams 1,8,32] [--tokens 3,10]
        [--reps 5] [--quick] [--eager-prefill] [--out docs/benchmarks.md]

One model, both sides: the peer's LLaVA of moondream2's shape
(``vlm_peer.make_peer``: SigLIP 27 x 1152 at 378 px, 729 features, Phi-1.5
text, random bf16), built once. bubblefree serves it through
``cuda_backend/vlm`` (its vision tower and projector in the image prefill,
replayed from graphs per image count unless ``--eager-prefill``; the text
decoder on the two slots); transformers runs ``generate`` on it.
Each cell is ``streams`` requests of the same shape submitted at once
(``[BOS, 729 image positions, 12 prompt tokens]``, a fresh image each, no
stop token, ``tokens`` new tokens), timed from submit to the last answer,
like the peer's batch: req/s is ``streams`` over the p50 wall. The image
processor runs on the caller's thread before the clock starts (the peer's
pixels are made on the device), and is reported apart. Modes alternate
(P B A A B P ...) and must give the same tokens (I8).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bubblefree.bench.doc_block import write_block
from bubblefree.bench.vlm_peer import BOS, PROMPT, make_peer, time_requests
from bubblefree.core import Engine, Request, Status

BEGIN, END = "<!-- llava-speed:begin -->", "<!-- llava-speed:end -->"
MODES = {"pipelined": True, "blocking": False, "auto": "auto"}
ORDER = ("pipelined", "blocking", "auto", "auto", "blocking", "pipelined")


def make_backend(model, device: torch.device, quick: bool, prefill_graphs: bool = True):
    """The peer's model served; no tokenizer: the image's block is LLaVA's
    expansion, its pixels SigLIP's."""
    from transformers import SiglipImageProcessor

    from bubblefree.cuda_backend.vlm.backend import VlmBackend
    from bubblefree.cuda_backend.vlm.model import VisionLanguage
    from bubblefree.cuda_backend.vlm.pixels import TokenRepeat

    config = model.config
    side = config.vision_config.image_size
    processor = TokenRepeat(SiglipImageProcessor(size={"height": side, "width": side}), None,
                            config.image_token_id, lambda _, n=config.image_seq_length: n)
    options = dict(max_rows=8, max_seqs=16, num_pages=256) if quick else dict(max_rows=64, max_seqs=128)
    return VlmBackend(VisionLanguage.of(model), processor, [BOS], "<image>",
                      max_prefill_tokens=8192 if not quick else 2048, prefill_graphs=prefill_graphs,
                      **options)


@contextlib.contextmanager
def transformers_attention(backend):
    """The peer's turn on the shared model: transformers' own attention
    (the backend routes the text decoder's through the paged one), then
    the paged one back."""
    from bubblefree.cuda_backend.loader import use_paged_attention

    backend.vl.text.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        use_paged_attention(backend.vl.text)


def pictures(count: int, side: int, rng: np.random.Generator) -> list[Image.Image]:
    return [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(count)]


def one_batch(engine: Engine, backend, images: list[Image.Image], tokens: int) -> tuple[float, list, float]:
    """``images`` as one batch of requests; (wall s, tokens, host ms per image)."""
    start = time.perf_counter()
    refs = [backend.image_ref(image) for image in images]
    host_ms = 1e3 * (time.perf_counter() - start) / len(images)
    requests = [Request(prompt=tuple(PROMPT), max_tokens=tokens, stop_ids=frozenset(), image=ref) for ref in refs]
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)
    start = time.perf_counter()
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    wall = time.perf_counter() - start
    results = [h.result for h in handles]
    bad = [r for r in results if r.status is not Status.COMPLETED]
    if bad:
        raise RuntimeError(f"{len(bad)} requests did not complete: {bad[0].finish_reason}")
    return wall, [r.tokens for r in results], host_ms


def measure(backend, streams: int, tokens: int, reps: int, seed: int) -> dict:
    """Every mode on the same images, alternating; p50 and p99 wall per mode."""
    side = backend.vl.vlm.config.vision_config.image_size
    engines = {mode: Engine(backend, pipelined=flag) for mode, flag in MODES.items()}
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    answers: dict[str, list] = {mode: [] for mode in MODES}
    host = []
    rng = np.random.default_rng(seed)
    batches = [pictures(streams, side, rng) for _ in range(reps + 1)]
    for i, images in enumerate(batches):
        for mode in ORDER[:3] if i == 0 else ORDER[(i % 2) * 3:(i % 2) * 3 + 3]:
            wall, got, host_ms = one_batch(engines[mode], backend, images, tokens)
            if i:  # the first batch warms every mode up
                walls[mode].append(wall)
                host.append(host_ms)
            answers[mode].append(got)
    same = answers["pipelined"] == answers["blocking"] == answers["auto"]
    out = {"streams": streams, "tokens": tokens, "same_tokens": same,
           "host_ms_per_image": statistics.median(host)}
    for mode, ws in walls.items():
        p50 = statistics.median(ws)
        out[mode] = dict(req_s=streams / p50, p50_ms=1e3 * p50, p99_ms=1e3 * max(ws))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| new tokens | streams | pipelined req/s | blocking req/s | auto req/s | transformers req/s | "
             "pipelined p50 / p99 ms | transformers p50 ms | pipelined / transformers | same tokens |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        p, b, a, t = r["pipelined"], r["blocking"], r["auto"], r["peer"]
        lines.append(f"| {r['tokens']} | {r['streams']} | {p['req_s']:.1f} | {b['req_s']:.1f} | {a['req_s']:.1f} | "
                     f"{t['req_s']:.1f} | {p['p50_ms']:.1f} / {p['p99_ms']:.1f} | {t['p50_ms']:.1f} | "
                     f"{p['req_s'] / t['req_s']:.2f}x | {'yes' if r['same_tokens'] else '**no**'} |")
    return "\n".join(lines)


def render(record: dict) -> str:
    host = ", ".join(f"{r['host_ms_per_image']:.2f}" for r in record["rows"])
    text = (f"## LLaVA (moondream2's shape) served, against its own `generate`, {record['date']}\n\n"
            f"{record['device']}, torch {record['torch']}, transformers {record['transformers']}. "
            f"Command: `{record['command']}`. One model on both sides: {record['model']}. Each cell: "
            f"*streams* requests submitted at once, a fresh image each, *new tokens* each (no stop token), "
            f"timed submit to last answer (p50 of {record['reps']}). The image processor on the caller's "
            f"thread, before the clock: {host} ms per image by cell."
            + (" A smoke run, not a measurement: a tiny model on the CPU." if record["quick"] else "")
            + f"\n\n{table(record['rows'])}\n")
    return text


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="3,10", help="new tokens per request, per cell")
    ap.add_argument("--streams", default="1,8,32", help="requests submitted at once, per cell")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU (tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="a markdown file to write the table into")
    ap.add_argument("--record", type=Path, default=None, help="a JSON file for the raw numbers")
    ap.add_argument("--eager-prefill", action="store_true",
                    help="the vision tower and the prefills without graphs (prefill_graphs=False)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    import transformers

    model = make_peer(device, dtype, tiny=args.quick)
    backend = make_backend(model, device, args.quick, prefill_graphs=not args.eager_prefill)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for streams in (int(s) for s in args.streams.split(",")):
            row = measure(backend, streams, tokens, args.reps, args.seed)
            with transformers_attention(backend):
                row["peer"] = time_requests(model, device, streams, tokens, reps=args.reps)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items()}), flush=True)
    vision = model.config.vision_config
    record = dict(date=datetime.date.today().isoformat(), command="python -m bubblefree.bench.llava_speed "
                  + " ".join(argv if argv is not None else sys.argv[1:]),
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU",
                  torch=torch.__version__, transformers=transformers.__version__, reps=args.reps,
                  quick=args.quick,
                  model=(f"LLaVA, SigLIP {vision.num_hidden_layers} x {vision.hidden_size} at "
                         f"{vision.image_size} px ({model.config.image_seq_length} features), "
                         f"Phi {model.config.text_config.num_hidden_layers} x {model.config.text_config.hidden_size}, "
                         f"{str(dtype).removeprefix('torch.')}, served {backend.decode_path}; "
                         f"{backend.prefill_path}"),
                  rows=rows)
    if args.record is not None:
        args.record.write_text(json.dumps(record, indent=1))
    text = render(record)
    if args.out is not None:
        write_block(args.out, BEGIN, END, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
