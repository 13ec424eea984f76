"""Assembly of a serving engine from a model source (imports torch).

Every option is checked first (``cuda_backend/options.py``), so a bad one is
refused before a model is loaded. Then order matters: location tokens, when
asked for, are added to the tokenizer and the embeddings grown *before* the
backend is built, because the backend sizes its buffers and captures its
CUDA graphs from the vocabulary.

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
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.loader import load_model
from bubblefree.cuda_backend.options import check_backend_options, check_device, check_dtype, flag
from bubblefree.cuda_backend.quiet import quiet_transformers
from bubblefree.skills import HFTokenizer, LocationCodec, SkillSet, location_tokens
from bubblefree.skills.codec import CodecError


def build_engine(cls, source: str | None, *, device: str | None, pipelined: bool | str,
                 dtype: Any = None, **backend_options: Any):
    add_locations = backend_options.pop("location_tokens", False)
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise InvalidRequest(f"path_or_default: must be a path or None, got {source!r}")
    if not (isinstance(pipelined, bool) or pipelined == "auto"):
        raise InvalidRequest(f'pipelined: must be True, False or "auto", got {pipelined!r}')
    flag()("location_tokens", add_locations)
    device, dtype = check_device(device), check_dtype(dtype)
    check_backend_options(backend_options)

    loaded = load_model(source, device=device, dtype=dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.source}: has no tokenizer; skills need one")
    tokenizer = HFTokenizer.wrap(loaded.tokenizer,
                                 add_tokens=location_tokens() if add_locations else ())
    if len(loaded.tokenizer) > loaded.vocab_size:
        # New rows start at the mean embedding: a text model without a region
        # head has no notion of them, but every output stays well formed.
        with quiet_transformers():  # its note on how new rows start is not for users
            loaded.model.resize_token_embeddings(len(loaded.tokenizer), mean_resizing=True)
    backend = CudaBackend(loaded, **backend_options)
    core = CoreEngine(backend, pipelined=pipelined, trace_limit=100_000)
    skills = SkillSet(tokenizer, core.register_mask, codec=_codec(tokenizer)).compile_all()
    return cls(core, skills, backend=backend)


def _codec(tokenizer: HFTokenizer) -> LocationCodec | None:
    try:
        return LocationCodec.for_tokenizer(tokenizer)
    except CodecError:  # no location tokens: the text skills only
        return None
