"""The decode loop in a background thread, and thread-safe submission.

The core Engine is single-threaded by design (sans-I/O). ``ServingLoop``
owns it: one thread ticks it while there is work and sleeps on a condition
when there is none; callers in any thread (or an asyncio loop) submit under
the same lock and are woken by the handle's listeners. A submit waits at
most one tick for the lock.

If a tick raises something other than a backend fault (``StepFailed`` is
handled inside the core), that is a bug or a dead device: every live
request is failed with the error named, so no caller waits forever, and the
loop refuses new work with the same message.
"""

from __future__ import annotations

import threading
from typing import Callable

from bubblefree.core import Engine as CoreEngine
from bubblefree.core import Handle, Request


class EngineStopped(RuntimeError):
    pass


class ServingLoop:
    def __init__(self, core: CoreEngine):
        self.core = core
        self._lock = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bubblefree-decode", daemon=True)
        self._thread.start()

    def submit(self, request: Request,
               listener: Callable[[Handle, int | None], None] | None = None) -> Handle:
        """Accept ``request`` (or raise ``InvalidRequest``); ``listener(handle,
        token)`` is called from the loop thread per committed token and once
        with ``None`` when the result is final."""
        with self._lock:
            if self._error is not None or self._closed:
                raise EngineStopped(f"the engine has stopped: {self._error or 'closed'}")
            handle = self.core.submit(request)
            if listener is not None:
                handle.listeners.append(listener)
            self._lock.notify()
        return handle

    def cancel(self, request_id: int) -> bool:
        with self._lock:
            return self.core.cancel(request_id)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.core.has_work():
                    self._lock.wait()
                if self._closed:
                    for request_id in list(self.core.handles):
                        self.core.cancel(request_id)
                    self._drain()
                    return
                try:
                    self.core.tick()
                except BaseException as err:  # noqa: BLE001 - fail everyone, name the error
                    self._error = err
                    self.core.abort(f"engine error: {type(err).__name__}: {err}")
                    return

    def _drain(self) -> None:
        try:
            self.core.run_until_idle(max_ticks=10_000)
        except BaseException as err:  # noqa: BLE001
            self._error = err
