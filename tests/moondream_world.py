"""What the moondream backend tests share: pictures, a decode state that asks
values on a schedule, the Engine run, and the native model's answer over the
whole sequence (the reference the engine's paged paths are checked against)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from bubblefree.core.engine import Engine
from bubblefree.core.values import Request, SamplingParams, Status, ValueKind
from bubblefree.cuda_backend.moondream.region import coordinate_value, size_value

C, S = ValueKind.COORD, ValueKind.SIZE
OPTIONS = dict(page_size=16, num_pages=400, max_rows=4, max_seqs=8, max_prefill_tokens=3200,
               min_graph_context=16)
# A point-like run (token and x from the prefill's hidden, then y), a
# detect-like one (x, y, size, then a token with the next x), and plain text
# between values, so flags are set and cleared in every order.
POINT = (C, C, C, C)
DETECT = (C, C, S, C, C, S)
MIXED = (None, C, None, S, S, None, C)


def picture(height: int, width: int, seed: int) -> Image.Image:
    # Smooth gradients plus noise: crops of one image differ, images differ.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1),
                     (x + y) * 127 // max(height + width, 1)], axis=-1)
    noise = rng.integers(0, 60, (height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8))


def reference(model, image, prompt, kinds, prompt_values=()):
    """The native model over the whole sequence at every step (no cache):
    each step's token is the argmax of the last position's logits; where a
    step asks a value it is decoded from the same hidden state, greedily,
    and its encoding is the next input, else the token's embedding. Without
    an image: the prompt alone, causal. ``prompt_values`` (PromptValues)
    replace their prompt positions' embeddings by their encodings, as
    moondream's reference does for a query's spatial references."""
    region, text = model.region, model.text
    tokens, values = [], []
    prefix = 0 if image is None else None  # None: the config's, BOS and the image
    device = text.wte.device
    with torch.no_grad():
        x = text.embed(torch.tensor(prompt, device=device))  # [L, D]
        for pv in prompt_values:
            v = torch.tensor(pv.value if pv.kind is S else [pv.value], dtype=x.dtype, device=device)
            x[pv.index] = region.encode_size(v) if pv.kind is S else region.encode_coordinate(v)
        if image is not None:
            x = torch.cat([model.image_prefix(image), x])
        for kind in kinds:
            h = text(x[None], prefix=prefix)[0, -1]  # before the final norm
            tokens.append(int(text.logits(h).argmax()))
            if kind is C:
                value = coordinate_value(region.decode_coordinate(h).argmax(), 1024)
                nxt = region.encode_coordinate(value.reshape(1))
                values.append(float(value))
            elif kind is S:
                size = size_value(region.decode_size(h).argmax(-1), 1024)  # [2]
                nxt = region.encode_size(size)
                values.append((float(size[0]), float(size[1])))
            else:
                nxt = text.embed(torch.tensor(tokens[-1], device=device))
                values.append(None)
            x = torch.cat([x, nxt[None]])
    return [tokens, values]


class Script:
    """A decode state asking the values of ``kinds``, one per step, and
    keeping what it was given."""

    def __init__(self, kinds):
        self.kinds, self.values = kinds, []

    def mask_id(self):
        return None

    def value_kind(self):
        return self.kinds[len(self.values)]

    def advance(self, token, value):
        self.values.append(value)
        return len(self.values) == len(self.kinds)


def request(ref, prompt, kinds, sampling=SamplingParams(), prompt_values=()):
    return Request(prompt=tuple(prompt), max_tokens=len(kinds) + 1, image=ref,
                   decode_state=lambda: Script(kinds), sampling=sampling,
                   finisher=lambda tokens, state: tuple(state.values), prompt_values=prompt_values)


def run(backend, requests, pipelined=True):
    engine = Engine(backend, pipelined=pipelined)
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle(max_ticks=10_000)
    engine.check_integrity()
    results = [h.result for h in handles]
    assert all(r.status is Status.COMPLETED for r in results), results
    return [[list(r.tokens), list(r.output)] for r in results]


def recording(backend, monkeypatch):
    """Record every plan the backend launches."""
    plans, launch = [], backend.launch

    def record(slot, plan):
        plans.append(plan)
        return launch(slot, plan)
    monkeypatch.setattr(backend, "launch", record)
    return plans
