"""Assembly of a serving engine from a model source (imports torch).

Order matters: the skills' location tokens are added to the tokenizer and
the embeddings grown *before* the backend is built, because the backend
sizes its buffers and captures its CUDA graphs from the vocabulary.
"""

from __future__ import annotations

from typing import Any

from bubblefree.core import Engine as CoreEngine
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.loader import load_model
from bubblefree.skills import HFTokenizer, SkillSet, location_tokens


def build_engine(cls, source: str | None, *, device: str | None, pipelined: bool,
                 dtype: Any = None, **backend_options: Any):
    loaded = load_model(source, device=device, dtype=dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"{loaded.source}: has no tokenizer; skills need one")
    tokenizer = HFTokenizer.wrap(loaded.tokenizer, add_tokens=location_tokens())
    if len(loaded.tokenizer) > loaded.vocab_size:
        # New rows start at the mean embedding: a text model without a region
        # head has no notion of them, but every output stays well formed.
        loaded.model.resize_token_embeddings(len(loaded.tokenizer), mean_resizing=True)
    backend = CudaBackend(loaded, **backend_options)
    core = CoreEngine(backend, pipelined=pipelined, trace_limit=100_000)
    skills = SkillSet(tokenizer, core.register_mask).compile_all()
    return cls(core, skills, backend=backend)
