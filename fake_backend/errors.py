"""What the simulated GPU raises when the engine misuses it.

Real hardware does not raise here: it silently reads a stale buffer,
overwrites a copy in flight, or attends over another sequence's KV. The fake
turns each of those into a loud error so a test points at the engine bug.
These are *not* ``StepFailed``: a fault is the device's failure and the
engine must survive it; a misuse is the engine's bug and must stop the test
(hence ``AssertionError``). Every contract misuse the CUDA backend refuses
as ``core.protocol.ProtocolMisuse`` is one of these here.
"""

from __future__ import annotations

from bubblefree.core.protocol import ProtocolMisuse


class HardwareMisuse(ProtocolMisuse, AssertionError):
    """The engine drove the device in a way real hardware would corrupt.

    Raised before any state changes, so the backend is as it was before the
    call (h11's rule: an illegal move leaves the state unchanged).
    """


class KVCorruption(HardwareMisuse):
    """A forward read KV that is not its own sequence's: a wrong page table,
    a page handed to another sequence while still owned (I6), or a position
    never written."""
