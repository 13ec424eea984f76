"""The backend protocol moved to ``core/protocol.py``, beside its call-order
table, plan checks and errors; this name stays for importers not yet moved."""

from bubblefree.core.protocol import Backend, Capacity

__all__ = ["Backend", "Capacity"]
