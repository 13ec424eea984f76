"""Public ``bubblefree.Engine``s on the simulated GPU with images.

Two models, the two ways an image model serves the spatial skills:

- ``moon_engine``: moondream2's way. A region head (``RegionHeadCodec``:
  values beside the tokens), moondream's prompt templates (spelled in the
  demo tokenizer's words), BOS the same id as EOS, as in moondream2.
- ``loc_engine``: a text model's way. Location tokens (``LocationCodec``)
  and the plain prompts, on a backend that also takes images; segment runs.

Expected results come from the fake model itself (``FakeModel.expect``),
with no backend and no engine: the tokens and values a request must get,
replayed through its own decode state and finisher.
"""

from __future__ import annotations

import io
from typing import Any

import attrs
import numpy as np
import pytest
from PIL import Image

from bubblefree import Engine
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import SamplingParams
from bubblefree.fake_backend import FakeBackend, FakeModel, stable_hash
from bubblefree.skills import LocationCodec, RegionHeadCodec, SkillSet, demo_tokenizer
from bubblefree.skills.templates import MoondreamTemplates
from tests.serving_world import Gate

WORDS = demo_tokenizer(coord_bins=64, size_bins=16)
# Two of the small vocabulary's ids stand in for the spatial-reference
# placeholders (moondream's coord_id and size_id): the forward never reads
# them, it reads the values' encodings at their positions.
MOON_TOK = attrs.evolve(WORDS, templates=MoondreamTemplates.from_text(
    WORDS, bos_id=WORDS.eos_id, coord_id=len(WORDS) - 2, size_id=len(WORDS) - 1))
EOS = WORDS.eos_id
KINDS = ("pil", "path", "bytes", "array", "encoded")


def scores_model(eos_every: int = 6, gate: Gate | None = None) -> FakeModel:
    """Scores a pure function of the context; EOS wins, wherever a mask
    allows it, on one position in ``eos_every``, so answers and lists end at
    varied lengths. ``gate`` can hold the decode thread while it samples."""
    def scores(prompt, position, prev):
        if gate is not None:
            gate.check(prompt, position)
        base = stable_hash(len(prompt), prompt[0], prompt[-1], position, prev)
        out = [(stable_hash(base, v) >> 11) / (1 << 53) for v in range(len(WORDS))]
        out[EOS] = 2.0 if stable_hash(position, prompt[0]) % eos_every == 0 else -1.0
        return out
    return FakeModel(vocab_size=len(WORDS), eos_id=EOS, score_fn=scores)


def _engine(tok, codec, *, gate: Gate | None, pipelined: bool, eos_every: int,
            max_image_pixels: int | None, **backend: Any) -> Engine:
    options = dict(num_pages=512, max_rows=8, max_seqs=16, max_context=512, max_prefill_tokens=128,
                   image_length=5)
    options.update(backend)
    core = CoreEngine(FakeBackend(model=scores_model(eos_every, gate), **options), pipelined=pipelined,
                      trace_limit=50_000)
    skills = SkillSet(tok, core.register_mask, codec=codec).compile_all()
    extra = {} if max_image_pixels is None else {"max_image_pixels": max_image_pixels}
    return Engine(core, skills, **extra)


def moon_engine(*, gate: Gate | None = None, pipelined: bool = True, eos_every: int = 6,
                max_image_pixels: int | None = None, **backend: Any) -> Engine:
    return _engine(MOON_TOK, RegionHeadCodec.for_tokenizer(MOON_TOK), gate=gate, pipelined=pipelined,
                   eos_every=eos_every, max_image_pixels=max_image_pixels, **backend)


def loc_engine(*, gate: Gate | None = None, pipelined: bool = True, eos_every: int = 6,
               max_image_pixels: int | None = None, **backend: Any) -> Engine:
    codec = LocationCodec.for_tokenizer(WORDS, coord_bins=64, size_bins=16)
    return _engine(WORDS, codec, gate=gate, pipelined=pipelined, eos_every=eos_every,
                   max_image_pixels=max_image_pixels, **backend)


@pytest.fixture(scope="module")
def moon():
    """A moondream-shaped engine (region head) for a test module."""
    engine = moon_engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def loc():
    """An engine whose coordinates are location tokens, for a test module."""
    engine = loc_engine()
    yield engine
    engine.close()


def picture(seed: int, width: int = 48, height: int = 32) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")  # lossless: every kind holds the same pixels
    return out.getvalue()


def as_kind(engine: Engine, image: Image.Image, kind: str, folder) -> Any:
    """``image`` handed over as a PIL image, a path, bytes, an array, or an
    ``EncodedImage`` made by ``engine``."""
    if kind == "pil":
        return image
    if kind == "path":
        path = folder / f"{abs(hash(image.tobytes()))}.png"
        path.write_bytes(png(image))
        return path
    if kind == "bytes":
        return png(image)
    if kind == "array":
        return np.asarray(image)
    return engine.encode_image(image)


class _Masks:
    def __init__(self, backend):
        self.backend = backend

    def __getitem__(self, mask_id):
        return self.backend.allowed(mask_id)


def expected(engine: Engine, skill: str, *, image: Any = None, sampling: Any = None,
             max_tokens: int | None = None, **args: Any) -> tuple[tuple[int, ...], Any]:
    """(tokens, output) the engine must return for this call, from the fake
    model's own computation under the skill's states."""
    args = dict(args, max_tokens=max_tokens)
    if image is not None:
        args["image"] = image
    request = engine._request(skill, SamplingParams.of(sampling), args)
    state = request.decode_state()
    backend = engine.core.backend
    got = backend.model.expect(request.prompt, request.max_tokens, request.sampling, request.stop_ids,
                               image=request.image, state=state, masks=_Masks(backend),
                               prompt_values=request.prompt_values)
    return got.tokens, request.finisher(got.tokens, state)


def tiny_checkpoint(folder, seed: int = 0):
    """A moondream2 checkpoint directory as ``from_pretrained`` reads one
    (config.json, model.safetensors, tokenizer.json): the tiny config with
    ``random_model``'s weights from ``seed`` and the small word tokenizer,
    its templates in the config. Returns ``folder``."""
    import json

    import torch
    from safetensors.torch import save_file

    from bubblefree.checkpoints import END, text_templates, word_tokenizer
    from bubblefree.cuda_backend.moondream.config import tiny_config
    from bubblefree.cuda_backend.moondream.weights import config_to_json, random_model

    raw = word_tokenizer()
    model = random_model(tiny_config(), seed=seed, dtype=torch.float32)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    config = config_to_json(tiny_config())
    end = raw.token_to_id(END)
    config["tokenizer"] = {"bos_id": end, "eos_id": end, "templates": text_templates(raw)}
    (folder / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": config}))
    raw.save(str(folder / "tokenizer.json"))
    return folder


def lanczos_by_axis(image: Image.Image, height: int, width: int) -> np.ndarray:
    """Pillow's Lanczos one axis at a time, written out: the width first,
    unless the height first leaves the smaller image between the passes
    (Pillow's own two-axis resize orders its passes by size, differently
    across versions; one axis at a time is unambiguous)."""
    axes = [(width, image.height), (width, height)]
    if width * image.height > image.width * height:
        axes = [(image.width, height), (width, height)]
    for size in axes:
        if size != image.size:
            image = image.resize(size, Image.Resampling.LANCZOS)
    return np.asarray(image)
