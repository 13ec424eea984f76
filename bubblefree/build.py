"""Assembly of a serving engine from a model source (imports torch).

Every option is checked first (``cuda_backend/options.py``), so a bad one is
refused before a model is loaded. Then order matters: location tokens, when
asked for, are added to the tokenizer and the embeddings grown *before* the
backend is built, because the backend sizes its buffers and captures its
CUDA graphs from the vocabulary.

A local moondream2 checkpoint directory (``checkpoints.is_moondream``)
builds the moondream backend instead (``build_moondream``): its region
head, its tokenizer.json and its prompt templates; a ``MoondreamConfig``
gives it random weights, for tests and benchmarks. A transformers
vision-language checkpoint (``checkpoints.is_vision_language``) builds the
VLM backend (``build_vision_language``).

Location tokens are opt-in (``location_tokens=True``): a text model has
never seen them, so by default it keeps its own vocabulary and serves the
text skills; the spatial skills then refuse requests (``SkillSet``). A model
whose tokenizer already holds them gets the spatial skills either way.
"""

from __future__ import annotations

import os
from typing import Any

from bubblefree.core import Engine as CoreEngine
from bubblefree.core import InvalidRequest
from bubblefree.core.values import shown
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.loader import load_model
from bubblefree.cuda_backend.options import check_backend_options, check_device, check_dtype, flag
from bubblefree.cuda_backend.quiet import quiet_transformers
from bubblefree.encoded import check_max_pixels
from bubblefree.images import DEFAULT_MAX_PIXELS
from bubblefree.skills import HFTokenizer, LocationCodec, RegionHeadCodec, SkillSet, location_tokens
from bubblefree.skills.codec import CodecError
from bubblefree.skills.registry import BUILTIN, Registry


def build_engine(cls, source: str | None, *, device: str | None, pipelined: bool | str,
                 dtype: Any = None, max_image_pixels: int = DEFAULT_MAX_PIXELS,
                 registry: Registry = BUILTIN, **backend_options: Any):
    from bubblefree.checkpoints import is_moondream, is_vision_language

    if is_moondream(source):
        return build_moondream(cls, os.fspath(source), device=device, pipelined=pipelined, dtype=dtype,
                               max_image_pixels=max_image_pixels, registry=registry, **backend_options)
    if is_vision_language(source):
        return build_vision_language(cls, os.fspath(source), device=device, pipelined=pipelined,
                                     dtype=dtype, max_image_pixels=max_image_pixels, registry=registry,
                                     **backend_options)
    add_locations = backend_options.pop("location_tokens", False)
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise InvalidRequest(f"path_or_default: must be a path or None, got {shown(source)}")
    check_pipelined(pipelined)
    check_registry(registry)
    flag()("location_tokens", add_locations)
    device, dtype = check_device(device), check_dtype(dtype)
    check_max_pixels(max_image_pixels)
    check_backend_options(backend_options)

    loaded = load_model(source, device=device, dtype=dtype)
    if loaded.tokenizer is None:
        raise ModelLoadError(f"{loaded.source}: has no tokenizer; skills need one")
    if len(loaded.tokenizer) > loaded.vocab_size:  # before tokens of ours are added
        raise ModelLoadError(f"{loaded.source}: its tokenizer has {len(loaded.tokenizer)} tokens and its "
                             f"model {loaded.vocab_size} embeddings: they are not one checkpoint's")
    tokenizer = HFTokenizer.wrap(loaded.tokenizer,
                                 add_tokens=location_tokens() if add_locations else ())
    if len(loaded.tokenizer) > loaded.vocab_size:
        # New rows start at the mean embedding: a text model without a region
        # head has no notion of them, but every output stays well formed.
        with quiet_transformers():  # its note on how new rows start is not for users
            loaded.model.resize_token_embeddings(len(loaded.tokenizer), mean_resizing=True)
    backend = CudaBackend(loaded, **backend_options)
    core = CoreEngine(backend, pipelined=pipelined, trace_limit=100_000)
    skills = SkillSet(tokenizer, core.register_mask, codec=_codec(tokenizer), registry=registry)
    return cls(core, skills, backend=backend, max_image_pixels=max_image_pixels)


def check_pipelined(pipelined: Any) -> None:
    if not (isinstance(pipelined, bool) or pipelined == "auto"):
        raise InvalidRequest(f'pipelined: must be True, False or "auto", got {shown(pipelined)}')


def check_registry(registry: Any) -> None:
    # With the other options, before loading: a typo would cost a load.
    if not isinstance(registry, Registry):
        raise InvalidRequest(f"registry: must be a bubblefree.skills.registry.Registry (BUILTIN.with_skill"
                             f"(MySkill()), say), got {type(registry).__name__}")


def _codec(tokenizer: HFTokenizer) -> LocationCodec | None:
    try:
        return LocationCodec.for_tokenizer(tokenizer)
    except CodecError:  # no location tokens: the text skills only
        return None


# -- moondream2 ---------------------------------------------------------------

def build_moondream(cls, source: Any, *, device: Any, pipelined: bool | str, dtype: Any = None,
                    seed: int = 0, tokenizer: Any = None, max_image_pixels: int = DEFAULT_MAX_PIXELS,
                    registry: Registry = BUILTIN, **backend_options: Any):
    """An engine on moondream2: a local checkpoint directory (its weights,
    config and tokenizer.json), or a ``MoondreamConfig`` with random weights
    from ``seed`` (``tokenizer``: a ``tokenizers.Tokenizer``, default a small
    word-level one, whose BOS/EOS and templates then replace the config's).
    The region head gives the spatial skills their values; the prompts are
    moondream's templates."""
    from bubblefree.checkpoints import moondream_tokenizer
    from bubblefree.cuda_backend.moondream.build import build

    if backend_options.pop("location_tokens", False):
        raise InvalidRequest("location_tokens: moondream2 points and detects through its region head; "
                             "it takes no location tokens")
    check_pipelined(pipelined)
    check_registry(registry)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidRequest(f"seed: must be an int >= 0, got {shown(seed)}")
    device, dtype = check_device(device), check_dtype(dtype)
    crops_on_device = backend_options.pop("crops_on_device", True)  # moondream's own option
    if not isinstance(crops_on_device, bool):
        raise InvalidRequest(f"crops_on_device: must be True or False, got {shown(crops_on_device)}")
    check_max_pixels(max_image_pixels)
    check_backend_options(backend_options)
    source, raw, config = _moondream_source(source, tokenizer)
    skills_tokenizer = moondream_tokenizer(raw, config.tokenizer)
    backend_options["crops_on_device"] = crops_on_device
    backend, _ = build(source, device=device, dtype=dtype, seed=seed, **backend_options)
    core = CoreEngine(backend, pipelined=pipelined, trace_limit=100_000)
    skills = SkillSet(skills_tokenizer, core.register_mask,
                      codec=RegionHeadCodec.for_tokenizer(skills_tokenizer), registry=registry)
    return cls(core, skills, backend=backend, max_image_pixels=max_image_pixels)


def _moondream_source(source: Any, raw: Any) -> tuple[Any, Any, Any]:
    """What ``build`` takes, the tokenizer the skills wrap, and the config
    whose BOS, EOS and templates they use. A checkpoint directory is opened
    here: its config.json and tokenizer.json are read and checked before
    its weights, so a bad one costs no load of GBs onto the device."""
    import attrs

    from bubblefree.checkpoints import placeholder_ids, text_templates, word_tokenizer
    from bubblefree.cuda_backend.moondream.config import MoondreamConfig, TokenizerConfig
    from bubblefree.cuda_backend.moondream.weights import open_checkpoint

    if not isinstance(source, MoondreamConfig):
        checkpoint = open_checkpoint(source)
        raw = raw if raw is not None else checkpoint.tokenizer
        if raw is None:
            raise ModelLoadError(f"{source}: has no tokenizer.json; the skills need one")
        return checkpoint, raw, checkpoint.config
    raw = raw if raw is not None else word_tokenizer()
    end = raw.token_to_id("<|endoftext|>")
    if end is None:
        raise InvalidRequest("tokenizer: must hold <|endoftext|> (moondream2's BOS and EOS)")
    config = attrs.evolve(source, tokenizer=TokenizerConfig(bos_id=end, eos_id=end,
                                                            templates=text_templates(raw),
                                                            **placeholder_ids(raw)))
    if raw.get_vocab_size(with_added_tokens=True) > config.text.vocab_size:
        raise InvalidRequest(f"tokenizer: {raw.get_vocab_size()} tokens, more than the config's "
                             f"vocab_size {config.text.vocab_size}")
    return config, raw, config


# -- transformers vision-language models (cuda_backend/vlm) ---------------------------

def build_vision_language(cls, path: str, *, device: Any, pipelined: bool | str, dtype: Any = None,
                          max_image_pixels: int = DEFAULT_MAX_PIXELS, registry: Registry = BUILTIN,
                          **backend_options: Any):
    """An engine on a local transformers vision-language checkpoint
    (``cuda_backend/vlm``): its weights, its processor (tokenizer and image
    processor) and its chat template, which places the image in the user's
    turn. The text
    skills answer about images; the spatial ones need location tokens the
    model has never seen, so they are refused as on a text model."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.vlm.backend import VlmBackend
    from bubblefree.cuda_backend.vlm.load import load_vision_language, open_vision_language

    if backend_options.pop("location_tokens", False):
        raise InvalidRequest("location_tokens: a vision-language checkpoint keeps its own vocabulary")
    check_pipelined(pipelined)
    check_registry(registry)
    device, dtype = check_device(device), check_dtype(dtype)
    check_max_pixels(max_image_pixels)
    check_backend_options(backend_options)
    # The tokenizer, processor and chat template are checked before the
    # weights are read: a bad one costs no load of minutes and GBs.
    checkpoint = open_vision_language(path)
    try:
        tokenizer = HFTokenizer.wrap(checkpoint.tokenizer, image_token=checkpoint.image_token)
    except ValueError as ex:
        raise ModelLoadError(f"{path}: {ex}") from ex
    loaded = load_vision_language(checkpoint, device=device, dtype=dtype)
    turn = tokenizer.image_turn
    backend = VlmBackend(loaded.model, loaded.processor, turn.head, turn.token, **backend_options)
    core = CoreEngine(backend, pipelined=pipelined, trace_limit=100_000)
    skills = SkillSet(tokenizer, core.register_mask, codec=_codec(tokenizer), registry=registry)
    return cls(core, skills, backend=backend, max_image_pixels=max_image_pixels)


def random_config(config: Any):
    """``"tiny"`` (CPU tests: moondream2's geometry, small widths), ``"full"``
    (moondream2's shapes), or a ``MoondreamConfig`` as it is."""
    from bubblefree.cuda_backend.moondream.config import MOONDREAM2, MoondreamConfig, tiny_config

    if isinstance(config, MoondreamConfig):
        return config
    named = {"tiny": tiny_config, "full": lambda: MOONDREAM2}
    if config not in named:
        raise InvalidRequest(f"config: must be 'tiny', 'full' or a MoondreamConfig, got {shown(config)}")
    return named[config]()
