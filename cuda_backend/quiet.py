"""Loading without transformers' chatter: its progress bars and warnings.

A normal load prints nothing. transformers keeps its verbosity and its
progress-bar switch as process-wide settings, so they are changed only for
the load and put back afterwards. Loads may overlap in threads: the first
one in saves the settings and the last one out restores them, so one load
finishing never turns the chatter back on under another.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from transformers.utils import logging as hf_logging

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, bool] | None = None


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Errors still log; warnings, info and progress bars do not."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                verbosity, bars = _saved
                hf_logging.set_verbosity(verbosity)
                if bars:
                    hf_logging.enable_progress_bar()
                _saved = None
