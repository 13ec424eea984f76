"""Mask preparation per decode step for a batch of mixed skill calls, and
how it scales with the vocabulary and the batch.

Skills compile every state's allowed set once and register it; per step a
row contributes only its state's mask id. This bench replays valid token
scripts through the skill states of 32 streams (query, caption, point,
detect, segment, yesno, round robin) and times, per step:

    mask ids   the finalize phase's work: ``state.mask_id()`` for every row
    advance    the commit phase's work: ``state.advance(token)`` for every row
    dense      for contrast, what a per-step mask builder pays: a dense
               vocabulary-sized mask per row, rebuilt every step (torch CPU)

at vocabularies of ~1k, 50k and 150k tokens, then the mask-id time at several
batch sizes. Prints the tables and appends them to docs/masks.md.

    python -m bubblefree.bench.masks [--steps 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bubblefree.skills import SkillSet, WordTokenizer, location_tokens
from bubblefree.skills.driver import MaskRecorder
from bubblefree.skills.word_tokenizer import DEMO_WORDS

VOCABS = (1_200, 50_000, 150_000)
BATCHES = (8, 32, 128)
CALLS = (("query", {"question": "what is the cat on"}), ("caption", {"length": "short"}),
         ("point", {"object": "cat"}), ("detect", {"object": "dog"}),
         ("segment", {"object": "cat"}), ("yesno", {"question": "is there a cat"}))


def tokenizer(vocab: int) -> WordTokenizer:
    """Demo words, location tokens, and filler up to ``vocab``; half the filler
    starts with a space, as in byte-level BPE vocabularies (it reaches the
    path grammar's first-symbol filter)."""
    fixed = DEMO_WORDS + location_tokens()
    n = max(0, vocab - len(fixed) - 2)
    return WordTokenizer.build(fixed + tuple(f"{' ' * (i % 2)}w{i}" for i in range(n)))


def scripts(skills: SkillSet, masks: MaskRecorder, streams: int, rng: random.Random):
    """Per stream: a request and a valid token script for it (EOS rare)."""
    sorted_sets: dict[int, list[int]] = {}
    out = []
    for i in range(streams):
        name, args = CALLS[i % len(CALLS)]
        req = skills.request(name, max_tokens=64, **args)
        state, script = req.decode_state(), []
        while len(script) < req.max_tokens:
            mask_id = state.mask_id()
            choices = sorted_sets.setdefault(mask_id, sorted(masks.allowed(mask_id)))
            eos_ok = skills.eos_id in masks.allowed(mask_id)
            token = skills.eos_id if eos_ok and rng.random() < 0.02 else rng.choice(choices)
            if token == skills.eos_id and not eos_ok:
                continue
            script.append(token)
            if state.advance(token) or token in req.stop_ids:
                break
        out.append((req, script))
    return out


def time_steps(streams, steps: int) -> tuple[float, float]:
    """(µs of mask ids per step, µs of advance per step), replaying scripts;
    a finished stream starts its request again from a fresh state."""
    states = [req.decode_state() for req, _ in streams]
    pos = [0] * len(streams)
    t_mask = t_adv = 0.0
    gc.collect()
    gc.disable()  # a collection inside a timed region is noise, not mask work
    for _ in range(steps):
        t0 = time.perf_counter()
        ids = tuple(s.mask_id() for s in states)
        t1 = time.perf_counter()
        for i, (req, script) in enumerate(streams):
            states[i].advance(script[pos[i]])
            pos[i] += 1
        t2 = time.perf_counter()
        t_mask += t1 - t0
        t_adv += t2 - t1
        for i, (req, script) in enumerate(streams):
            if pos[i] == len(script):  # outside the timed regions
                states[i], pos[i] = req.decode_state(), 0
        assert len(ids) == len(states)
    gc.enable()
    return t_mask / steps * 1e6, t_adv / steps * 1e6


def time_dense(streams, masks: MaskRecorder, vocab: int, steps: int) -> float:
    import torch

    torch.set_num_threads(1)  # the bookkeeping thread's view; no pool wake-ups
    idx = {i: torch.tensor(sorted(m)) for i, m in enumerate(masks.masks)}
    states = [req.decode_state() for req, _ in streams]
    pos = [0] * len(streams)
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for s in states:
            torch.zeros(vocab, dtype=torch.bool).index_fill_(0, idx[s.mask_id()], True)
        total += time.perf_counter() - t0
        for i, (req, script) in enumerate(streams):
            states[i].advance(script[pos[i]])
            pos[i] += 1
            if pos[i] == len(script):
                states[i], pos[i] = req.decode_state(), 0
    return total / steps * 1e6


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="docs/masks.md")
    args = ap.parse_args(argv)
    med = statistics.median

    configs = []
    for vocab in VOCABS:
        tok, masks = tokenizer(vocab), MaskRecorder()
        t = time.perf_counter()
        skills = SkillSet(tok, masks.register).compile_all()
        compile_ms = (time.perf_counter() - t) * 1e3
        streams = scripts(skills, masks, 32, random.Random(0))
        time_steps(streams, args.steps)  # warm-up, discarded
        configs.append((tok, masks, compile_ms, streams))
    # Repeats interleave the vocabularies, so a burst of load on the machine
    # lands on every row alike rather than on one.
    timed: list[list[tuple[float, float]]] = [[] for _ in configs]
    dense: list[list[float]] = [[] for _ in configs]
    for _ in range(args.repeats):
        for i, (tok, masks, _, streams) in enumerate(configs):
            timed[i].append(time_steps(streams, args.steps))
            dense[i].append(time_dense(streams, masks, len(tok), max(50, args.steps // 20)))
    rows, base = [], None
    for (tok, masks, compile_ms, _), t_runs, d_runs in zip(configs, timed, dense):
        mask_us, adv_us = med(r[0] for r in t_runs), med(r[1] for r in t_runs)
        dense_us = med(d_runs)
        base = base or (mask_us, adv_us, dense_us)
        rows.append(f"| {len(tok):,} | {compile_ms:.0f} | {len(masks.masks)} | {mask_us:.1f} "
                    f"({mask_us / base[0]:.2f}×) | {adv_us:.1f} ({adv_us / base[1]:.2f}×) | "
                    f"{dense_us:.0f} ({dense_us / base[2]:.0f}×) | {dense_us / mask_us:.0f}× |")
        print(rows[-1], flush=True)
    vocab_table = "\n".join([
        "| vocab | compile, once (ms) | masks registered | mask ids / step (µs) "
        "| advance / step (µs) | dense masks / step (µs) | dense ÷ mask ids |",
        "|---:|---:|---:|---:|---:|---:|---:|", *rows])

    tok, masks = tokenizer(50_000), MaskRecorder()
    skills = SkillSet(tok, masks.register).compile_all()
    brows = []
    for batch in BATCHES:
        streams = scripts(skills, masks, batch, random.Random(1))
        time_steps(streams, args.steps)  # warm-up, discarded
        us = med(time_steps(streams, args.steps)[0] for _ in range(args.repeats))
        brows.append(f"| {batch} | {us:.1f} | {us / batch:.3f} |")
        print(brows[-1], flush=True)
    batch_table = "\n".join(["| batch | mask ids / step (µs) | per row (µs) |",
                             "|---:|---:|---:|", *brows])

    header = (f"## Mask preparation, {datetime.date.today().isoformat()}\n\n"
              f"CPU: {platform.processor() or platform.machine()}, Python "
              f"{platform.python_version()}. Command: `python -m bubblefree.bench.masks --steps {args.steps} "
              f"--repeats {args.repeats}`. 32 streams of mixed skills; median of the repeats; "
              "ratios against the smallest vocabulary in parentheses. Absolute µs are of this "
              "CPU: read the ratios.\n\n")
    body = vocab_table + "\n\nBy batch, vocabulary 50k:\n\n" + batch_table
    print("\n" + body)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        intro = ("# Mask preparation per step\n\nSkills register each state's allowed set "
                 "once; a step costs one table lookup per row (O(batch)), whatever the "
                 "vocabulary. See docs/skills.md.\n\n")
        old = path.read_text() if path.exists() else intro
        path.write_text(old.rstrip() + "\n\n" + header + body + "\n")
    return body


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
