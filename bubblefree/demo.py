"""`make run`: real questions to the embedded model, answered concurrently.

Loads SmolLM2-135M-Instruct (converted from its GGUF once, then cached),
streams the first answer as it is decoded while the others share its
batches, prints every answer, then runs the same questions in blocking mode
— the same engine, one flag flipped — and prints a summary table.

    python -m bubblefree.demo [--max-tokens 64] [--model PATH]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from bubblefree.engine import Engine

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Why is the sky blue? Answer in one sentence.",
    "What is 12 times 12?",
    "Give one tip for writing clear code.",
    "Which planet is closest to the sun?",
)


def ask_all(engine: Engine, max_tokens: int, stream_first: bool) -> tuple[list, float]:
    """Submit every question at once; returns (results, seconds)."""
    done = threading.Semaphore(0)
    first_tokens: list[int] = []
    printed = [0]

    def listener(index: int):
        def on(handle, token):
            if token is None:
                done.release()
            elif index == 0 and stream_first:
                first_tokens.append(token)
                text = engine.skills.tokenizer.decode(first_tokens)
                if not text.endswith("\ufffd"):
                    print(text[printed[0]:], end="", flush=True)
                    printed[0] = len(text)
        return on

    start = time.perf_counter()
    handles = [engine.submit("query", question=q, max_tokens=max_tokens, listener=listener(i))
               for i, q in enumerate(QUESTIONS)]
    for _ in handles:
        done.acquire()
    elapsed = time.perf_counter() - start
    return [h.result for h in handles], elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="a model directory or .gguf (default: embedded)")
    args = ap.parse_args(argv)
    print("loading the model (the first run converts the GGUF and caches it)...", flush=True)
    t = time.perf_counter()
    engine = Engine.from_pretrained(args.model, max_rows=8, max_seqs=16, num_pages=1024,
                                    max_prefill_tokens=1024, max_context=2048)
    backend = engine.backend
    print(f"loaded in {time.perf_counter() - t:.1f} s on {backend.device} "
          f"({backend.dtype}); {len(QUESTIONS)} questions at once\n", flush=True)
    try:
        print(f"Q: {QUESTIONS[0]}\nA: ", end="", flush=True)
        piped, t_pipe = ask_all(engine, args.max_tokens, stream_first=True)
        print("\n")
        for q, r in zip(QUESTIONS[1:], piped[1:]):
            print(f"Q: {q}\nA: {r.output['answer']}\n")
        engine.core.pipelined = False  # the baseline: same engine, one flag away
        blocked, t_block = ask_all(engine, args.max_tokens, stream_first=False)
    finally:
        engine.close()
    same = [a.tokens for a in piped] == [b.tokens for b in blocked]
    tokens = sum(len(r.tokens) for r in piped)
    print("| mode | requests | tokens | seconds | tokens/s | identical answers |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, secs in (("pipelined", t_pipe), ("blocking", t_block)):
        print(f"| {mode} | {len(QUESTIONS)} | {tokens} | {secs:.2f} | {tokens / secs:.1f} | "
              f"{'yes' if same else 'no'} |")
    print(f"\n(device: {backend.device}; on a CPU the forward dominates, so the modes are "
          "close — the bubble pipelining removes is a GPU effect)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
