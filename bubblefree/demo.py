"""`make run`: real questions to the embedded model, answered concurrently.

Loads SmolLM2-135M-Instruct (converted from its GGUF once, then cached),
submits six questions together and streams the first answer as it is
decoded while the others share its batches, prints every answer, then times
the same questions in both modes (pipelined and blocking: the same engine,
one flag flipped), alternating after a warm-up, and prints a summary table.

Given a local moondream2 checkpoint (``--model PATH`` or the environment's
``BUBBLEFREE_MODEL``), it answers about a picture instead (``--image PATH``,
or one it draws): a caption streamed, a question, point and detect, all
submitted together on one encoded image, then the same timing of both modes.

    python -m bubblefree.demo [--max-tokens 64] [--model PATH] [--image PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from bubblefree.checkpoints import is_moondream, is_vision_language
from bubblefree.engine import Engine
from bubblefree.skills import TextStream

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Why is the sky blue? Answer in one sentence.",
    "What is 12 times 12?",
    "Give one tip for writing clear code.",
    "Which planet is closest to the sun?",
)


def printer(engine: Engine) -> Callable:
    """A listener that prints a request's text as its tokens commit. It runs
    on the decode thread: it prints and never blocks."""
    tok = engine.skills.tokenizer
    shown = TextStream(tok, frozenset({tok.eos_id}))

    def show(handle, token):
        if token is not None:
            print(shown.push([token]), end="", flush=True)
    return show


def submit_timed(engine: Engine, calls) -> tuple[list, float]:
    """Submit ``calls`` at once (one hand-over, so they share their first
    prefill and every decode step); returns (results, seconds)."""
    start = time.perf_counter()
    handles = engine.submit_many(calls)
    results = [h.result() for h in handles]
    return results, time.perf_counter() - start


def ask_all(engine: Engine, max_tokens: int, stream_first: bool) -> tuple[list, float]:
    """Every question at once, the first streamed when ``stream_first``."""
    show = printer(engine) if stream_first else None
    return submit_timed(engine, (
        ("query", dict(question=q, max_tokens=max_tokens, listener=show if i == 0 else None))
        for i, q in enumerate(QUESTIONS)))


def timed_modes(engine: Engine, ask: Callable[[], tuple[list, float]],
                rounds: int) -> dict[str, tuple[list, float]]:
    """``ask()`` in each mode ``rounds`` times, alternating, after one warm-up
    round, so neither gets the cold caches or the other's luck; the best
    time each."""
    ask()
    best: dict[str, tuple[list, float]] = {}
    for _ in range(rounds):
        for mode in ("pipelined", "blocking"):
            engine.pipelined = mode == "pipelined"
            results, secs = ask()
            if mode not in best or secs < best[mode][1]:
                best[mode] = (results, secs)
    engine.pipelined = True
    return best


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=_at_least_one, default=64)
    ap.add_argument("--model", default=os.environ.get("BUBBLEFREE_MODEL") or None,
                    help="a model directory or .gguf, or a moondream2 or LLaVA checkpoint directory "
                         "(default: $BUBBLEFREE_MODEL, else the embedded model)")
    ap.add_argument("--image", default=None, help="the picture to ask a moondream2 or LLaVA about "
                                                  "(default: one drawn here)")
    ap.add_argument("--rounds", type=_at_least_one, default=2, help="timed rounds per mode")
    args = ap.parse_args(argv)
    # Checked before the model loads: a bad path fails in a second, not after the load.
    if args.model is not None and not (os.path.isdir(args.model) or (
            os.path.isfile(args.model) and args.model.endswith(".gguf"))):
        ap.error(f"--model (or BUBBLEFREE_MODEL): {args.model!r} is not a model directory or a .gguf file")
    pictures = is_moondream(args.model) or is_vision_language(args.model)
    if args.image is not None and not pictures:
        ap.error("--image needs a moondream2 or LLaVA checkpoint (--model or BUBBLEFREE_MODEL)")
    if args.image is not None and not os.path.isfile(args.image):
        ap.error(f"--image: no file at {args.image!r}")
    if pictures:
        from bubblefree.picture_demo import main as picture_main

        return picture_main(args)
    print("loading the model (the first run converts the GGUF and caches it)...", flush=True)
    t = time.perf_counter()
    engine = Engine.from_pretrained(args.model, max_rows=8, max_seqs=16, num_pages=1024,
                                    max_prefill_tokens=1024, max_context=2048)
    backend = engine.backend
    print(f"loaded in {time.perf_counter() - t:.1f} s on {backend.device} "
          f"({backend.dtype}); {len(QUESTIONS)} questions at once\n", flush=True)
    try:
        print(f"Q: {QUESTIONS[0]}\nA: ", end="", flush=True)
        answers, _ = ask_all(engine, args.max_tokens, stream_first=True)
        print("\n")
        for q, r in zip(QUESTIONS[1:], answers[1:]):
            print(f"Q: {q}\nA: {r.output['answer']}\n")
        modes = timed_modes(engine, lambda: ask_all(engine, args.max_tokens, stream_first=False), args.rounds)
    finally:
        engine.close()
    same = len({tuple(r.tokens for r in results) for results, _ in modes.values()}) == 1
    tokens = sum(len(r.tokens) for r in modes["pipelined"][0])
    print(f"Both modes, {len(QUESTIONS)} questions submitted together, best of {args.rounds} "
          "alternating rounds after a warm-up:\n")
    print("| mode | requests | tokens | seconds | tokens/s | identical answers |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, (_, secs) in modes.items():
        print(f"| {mode} | {len(QUESTIONS)} | {tokens} | {secs:.2f} | {tokens / secs:.1f} | "
              f"{'yes' if same else 'no'} |")
    print(f"\n(device: {backend.device}; on a CPU the forward dominates, so the modes are "
          "close: the bubble pipelining removes is a GPU effect. The embedded model is a "
          "4-bit 135M model: its wrong answers are its own.)")
    return 0 if same else 1

if __name__ == "__main__":
    sys.exit(main())
