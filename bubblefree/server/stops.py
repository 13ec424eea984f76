"""OpenAI's ``stop`` strings over streamed text.

A stop string may arrive split over several pieces, so text that could be
the start of one is held back until it is known not to be; once one shows
up, the text before it is the answer and the request ends there.
"""

from __future__ import annotations

import attrs

# A stop string's length at most: its prefixes are tried against the text
# held back on the event loop's thread, so an unbounded one (a body may
# carry megabytes) would hold every other request up.
MAX_STOP_CHARS = 1000


@attrs.define
class StopText:
    stops: tuple[str, ...]
    _held: str = ""
    stopped: bool = False

    def push(self, piece: str) -> str:
        """The text that is final after ``piece``; sets ``stopped`` when a
        stop string appeared (the stop string and what follows are dropped)."""
        if self.stopped:
            return ""
        text = self._held + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self._held = True, ""
            return text[:min(cuts)]
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of the text: what was held back was no stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """The length of the longest proper prefix of ``stop`` that ``text`` ends with."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
