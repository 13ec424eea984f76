"""bubblefree: a serving engine whose decode loop never leaves the GPU waiting."""

from bubblefree.engine import Engine, RequestFailed
from bubblefree.loop import EngineStopped
from bubblefree.core import InvalidRequest, SamplingParams

__all__ = ["Engine", "EngineStopped", "InvalidRequest", "RequestFailed", "SamplingParams"]
