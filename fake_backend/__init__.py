"""A deterministic simulated GPU that satisfies ``core.protocol.Backend``.

Pure Python, virtual time, no randomness of its own: what it computes is
fixed by ``FakeModel``, how long it takes and where it fails by ``Timing``
and ``Fault``. Misuse that real hardware would silently corrupt raises
``HardwareMisuse`` (or ``KVCorruption``); device faults raise ``StepFailed``.
"""

from bubblefree.fake_backend.backend import FakeBackend
from bubblefree.fake_backend.errors import HardwareMisuse, KVCorruption
from bubblefree.fake_backend.model import FakeModel, stable_hash
from bubblefree.fake_backend.stats import Stats
from bubblefree.fake_backend.timing import Fault, Timing, Work, by_step

__all__ = [
    "FakeBackend", "FakeModel", "Fault", "HardwareMisuse", "KVCorruption", "Stats", "Timing",
    "Work", "by_step", "stable_hash",
]
