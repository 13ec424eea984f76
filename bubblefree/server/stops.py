"""OpenAI's ``stop`` strings over streamed text.

A stop string may arrive split over several pieces, so text that could be
the start of one is held back until it is known not to be; once one shows
up, the text before it is the answer and the request ends there.

The text is read a character at a time, whatever its pieces: the answer
ends before the first stop string to be complete (of two complete at the
same character, the longer), so where a client's pieces happen to break
never changes it. Each stop string keeps a matcher's state (the longest
prefix of it the text ends with, Knuth-Morris-Pratt), so a piece costs its
own length times the stop strings, not the stop strings' lengths: this runs
on the event loop's thread.
"""

from __future__ import annotations

import attrs

# A stop string's length at most (a body may carry megabytes of one).
MAX_STOP_CHARS = 1000


def _failure(stop: str) -> list[int]:
    """``fail[i]``: the longest proper prefix of ``stop[:i + 1]`` that is also its suffix."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


@attrs.define
class StopText:
    stops: tuple[str, ...]
    _held: str = ""
    stopped: bool = False
    _fail: list[list[int]] = attrs.field(init=False)
    _state: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not all(self.stops):
            raise ValueError("stop strings must not be empty")
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def push(self, piece: str) -> str:
        """The text that is final after ``piece``; sets ``stopped`` when a
        stop string appeared (the stop string and what follows are dropped)."""
        if self.stopped:
            return ""
        text = self._held + piece
        for at, char in enumerate(piece, start=len(self._held)):
            done = 0
            for i, (stop, fail) in enumerate(zip(self.stops, self._fail)):
                k = self._state[i]
                while k and stop[k] != char:
                    k = fail[k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    done, k = max(done, k), fail[k - 1]
                self._state[i] = k
            if done:
                self.stopped, self._held = True, ""
                return text[:at + 1 - done]
        keep = max(self._state, default=0)  # the longest start of a stop string the text ends with
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of the text: what was held back was no stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
