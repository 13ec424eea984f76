"""Errors the CUDA backend raises, each naming the problem in its message.

Loading and sizing problems are ``ValueError``s raised before anything runs;
a bad option (``options.py``) or a cache too small for one page is an
``InvalidRequest`` too, since the caller's configuration is what must change.
A plan ``launch`` cannot execute is the contract's ``PlanRejected``, and also
``StepFailed`` (so the engine fails that step's rows and keeps serving: the
launch enqueued nothing and the slot stays free) and ``InvalidRequest`` (so
a caller that drives the backend directly can catch it as a bad input).
"""

from __future__ import annotations

from bubblefree.core import protocol
from bubblefree.core.values import InvalidRequest, StepFailed


class ModelLoadError(ValueError):
    """A model directory or GGUF file is missing, unreadable or corrupt."""


class UnsupportedModel(ModelLoadError):
    """The model is not a decoder-only causal LM whose attention we can own."""


class CacheTooSmall(InvalidRequest):
    """Not enough memory (or too few configured pages) for the KV cache: a
    configuration the caller must change, refused before anything runs."""


class PlanRejected(protocol.PlanRejected, StepFailed, InvalidRequest):
    """A StepPlan that ``core.protocol.check_plan`` refuses (too many rows or
    tokens, a sequence past the context, a page or row slot out of range, a
    page shared by two rows)."""
