"""bubblefree: a serving engine whose decode loop never leaves the GPU waiting."""

from bubblefree.core import InvalidRequest, Result, SamplingParams, Status
from bubblefree.engine import EncodedImage, Engine
from bubblefree.handle import Handle, RequestFailed
from bubblefree.loop import EngineStopped

__all__ = ["EncodedImage", "Engine", "EngineStopped", "Handle", "InvalidRequest", "RequestFailed", "Result",
           "SamplingParams", "Status"]
