"""`make run` with a moondream2 or LLaVA checkpoint: questions about one picture.

The picture is encoded once (``encode_image``); a caption (streamed as it is
decoded), a question, and point and detect where the model has a region
head (moondream2), are submitted together and share their steps. Then the
same requests are timed in both modes (pipelined and blocking: one engine,
one flag), alternating after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from PIL import Image, ImageDraw

from bubblefree.demo import printer, submit_timed, timed_modes
from bubblefree.engine import Engine

QUESTION = "What shapes are in this picture, and what colours are they?"
POINT = "the red circle"
DETECT = "the blue square"
MAX_OBJECTS = 10


def drawn_picture() -> Image.Image:
    """A picture whose answers a reader can check at a glance: a red circle
    left, a blue square right, a green triangle below, on white."""
    image = Image.new("RGB", (640, 480), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((60, 80, 240, 260), fill=(220, 30, 30))
    draw.rectangle((380, 70, 560, 250), fill=(30, 60, 210))
    draw.polygon(((320, 300), (220, 450), (420, 450)), fill=(40, 170, 60))
    return image


def calls(engine: Engine, image: Any, max_tokens: int, show=None) -> list[tuple[str, dict]]:
    """Caption and query; point and detect where the model serves them (a
    region head: moondream2; a transformers VLM has none)."""
    spatial = [("point", dict(image=image, object=POINT, max_objects=MAX_OBJECTS)),
               ("detect", dict(image=image, object=DETECT, max_objects=MAX_OBJECTS))]
    return [("caption", dict(image=image, length="normal", max_tokens=max_tokens, listener=show)),
            ("query", dict(image=image, question=QUESTION, max_tokens=max_tokens)),
            *((name, args) for name, args in spatial if engine.skills.serves(name))]


def ask_all(engine: Engine, image: Any, max_tokens: int, stream_caption: bool) -> tuple[list, float]:
    """``calls``' requests submitted together; (results, seconds)."""
    return submit_timed(engine, calls(engine, image, max_tokens, printer(engine) if stream_caption else None))


def run(engine: Engine, picture: Any, max_tokens: int, rounds: int) -> bool:
    """Print the answers and the table; True when both modes gave the same tokens."""
    image = engine.encode_image(picture)
    print("Caption: ", end="", flush=True)
    results, _ = ask_all(engine, image, max_tokens, stream_caption=True)
    answer = results[1].output
    print(f"\n\nQ: {QUESTION}\nA: {answer['answer']}\n")
    if len(results) == 4:
        points, boxes = results[2].output, results[3].output
        print(f"Point at {POINT!r}: " + (", ".join(f"({p['x']:.3f}, {p['y']:.3f})" for p in points["points"])
                                          or "none found"))
        print(f"Detect {DETECT!r}: " + (", ".join(
            f"[{b['x_min']:.3f}, {b['y_min']:.3f}, {b['x_max']:.3f}, {b['y_max']:.3f}]"
            for b in boxes["objects"]) or "none found"))
        print("(coordinates are fractions of the picture's width and height, from its top left)\n")
    modes = timed_modes(engine, lambda: ask_all(engine, image, max_tokens, stream_caption=False), rounds)
    same = len({tuple(r.tokens for r in results) for results, _ in modes.values()}) == 1
    n = len(results)
    print(f"Both modes, the {n} requests submitted together on the encoded picture, best of {rounds} "
          "alternating rounds after a warm-up:\n")
    print("| mode | requests | tokens | seconds | identical answers |")
    print("|---|---:|---:|---:|---|")
    tokens = sum(len(r.tokens) for r in modes["pipelined"][0])
    for mode, (_, secs) in modes.items():
        print(f"| {mode} | {n} | {tokens} | {secs:.2f} | {'yes' if same else 'no'} |")
    return same


def main(args: argparse.Namespace) -> int:
    if args.image is not None:
        picture, where = args.image, args.image
    else:
        picture = drawn_picture()
        where = os.path.join(tempfile.gettempdir(), "bubblefree-picture.png")
        picture.save(where)
    print(f"loading {args.model}...", flush=True)
    t = time.perf_counter()
    engine = Engine.from_pretrained(args.model)
    backend = engine.backend
    print(f"loaded in {time.perf_counter() - t:.1f} s on {backend.device} ({backend.dtype}); "
          f"the picture: {where}\n", flush=True)
    try:
        same = run(engine, picture, args.max_tokens, args.rounds)
    finally:
        engine.close()
    return 0 if same else 1
