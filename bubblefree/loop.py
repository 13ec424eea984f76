"""The decode loop in its own thread, and the one door into it.

The core is single-threaded by design (sans-I/O). ``ServingLoop`` owns it:
only the decode thread ever calls it. Callers in any thread hand requests
and cancels over through an inbox (a deque behind a lock held for an append
or a swap, never for a step), and the loop drains the whole inbox before
each tick, so requests that arrive together are prefilled together and a
submit never waits for a step to finish.

Results come back through the core's listeners, which run after each tick on
the decode thread: they update the caller's ``Handle`` and call the caller's
own listener. A listener that raises fails its own request and nothing else.

If a tick raises something other than a backend fault (``StepFailed`` is
handled inside the core), that is a bug or a lost device: every accepted
request ends, failed with the error named, so no caller waits forever, and
the loop refuses new work with the same message. ``close`` cancels what is
live, lets in-flight steps commit, and ends the thread.
"""

from __future__ import annotations

import atexit
import collections
import functools
import inspect
import itertools
import os
import threading
import time
import warnings
import weakref
from typing import Callable

from bubblefree.core import Engine as CoreEngine
from bubblefree.core import Request, Result, Status
from bubblefree.core.engine import closed
from bubblefree.core.values import described, shown
from bubblefree.handle import Handle

Listener = Callable[[Handle, "int | None"], None]


# At most this many GIL yields gather concurrent submits after an idle wait.
GATHER_YIELDS = 16
# How long ``close`` waits for the decode thread (a listener may hold it),
# and how long, at most, interpreter exit waits for a loop nobody closed.
CLOSE_WAIT, EXIT_WAIT = 60.0, 10.0
# How often a caller waiting on the decode thread looks whether it still runs.
ALIVE_POLL = 0.1


class EngineStopped(RuntimeError):
    """The engine was closed, or stopped on an error it names."""


def _close_at_exit(ref: "weakref.ref[ServingLoop]") -> None:
    """At interpreter exit, a loop that nobody closed: end its decode thread
    (cancelling what is live; at most ``EXIT_WAIT`` or the loop's
    ``close_wait``, whichever is less, where a listener holds it) before the
    interpreter tears down what the thread may be running. Left running, a
    torch call on the daemon thread during finalization aborted the process
    ("terminate called without an active exception")."""
    loop = ref()
    if loop is None or os.getpid() != loop._pid:
        return
    loop.close(wait=False)
    loop._thread.join(timeout=min(loop.close_wait, EXIT_WAIT))


def check_undriven(core: CoreEngine) -> None:
    """Refuse a core another serving loop drives: two loops would number
    their requests from 0 alike and tick one state machine from two threads."""
    if core.driver is not None and core.driver() is not None:
        raise ValueError("this core engine is driven by another ServingLoop (another Engine's): "
                         "one loop a core; build an engine of its own for each")


class ServingLoop:
    def __init__(self, core: CoreEngine):
        check_undriven(core)
        core.driver = weakref.ref(self)
        self.core = core
        # Reentrant: a stream's garbage-collection finalizer cancels through
        # here, and the collector may run it on a thread that already holds
        # this lock (any allocation inside submit_all, or on the decode thread).
        self._wake = threading.Condition(threading.RLock())
        # ("submit", handle, listener) | ("cancel", handle, None) | ("pipelined", flag, made event)
        self._inbox: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._live: dict[int, Handle] = {}  # accepted and not ended; decode thread only
        # Their callers' listeners, told of the end here when the core cannot
        # tell them (it refused the request, or it is broken); decode thread only.
        self._listeners: dict[int, Listener] = {}
        self._taking: collections.deque = collections.deque()  # inbox items being taken
        # Submits in the inbox, for the core's auto rule (``Engine.arrivals``):
        # changed under the lock, read without it (an int's read is atomic).
        self._arriving = 0
        core.arrivals = lambda: self._arriving
        self._closed = False
        self._error: BaseException | None = None
        # fork() copies this object but not its decode thread: a child's
        # submits would wait for ever on a thread that is not there.
        self._pid = os.getpid()
        self.close_wait = CLOSE_WAIT  # seconds; per engine, so a test may shorten its own
        # When the decode thread last went round its loop (a tick, or waking
        # with nothing to do): ``stalled_for`` reads it, without the lock.
        self._moved = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="bubblefree-decode", daemon=True)
        # A weak reference: the hook keeps no model alive. While the thread
        # runs, its target holds the loop, so the hook finds it.
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        self._thread.start()

    # ----------------------------------------------------------- any thread
    def submit(self, request: Request, listener: Listener | None = None) -> Handle:
        """Accept ``request`` (or raise ``InvalidRequest`` naming the field, or
        ``EngineStopped``). ``listener(handle, token)`` runs on the decode
        thread after each tick that committed a token for it, then once with
        ``None`` when the Result is final."""
        return self.submit_all([(request, listener)])[0]

    def submit_all(self, items: list[tuple[Request, Listener | None]]) -> list[Handle]:
        """Accept all (each validated first: all or none), handed over at once,
        so they start in the same prefill where capacity allows."""
        for request, _ in items:
            self.core.validate(request)  # pure: the same checks the core applies
        # Before the lock too: in a child of fork() it may be held by a thread
        # that was not copied, and taking it would hang.
        self.check_running()
        with self._wake:
            self.check_running()
            handles = [Handle(next(self._ids), request, self) for request, _ in items]
            self._inbox.extend(("submit", h, listener) for h, (_, listener) in zip(handles, items))
            self._arriving += len(handles)
            self._wake.notify()
        return handles

    def cancel(self, handle: Handle) -> bool:
        if handle.done:
            return False
        if os.getpid() != self._pid:  # no decode thread here to take it: "taken" would be a lie
            raise EngineStopped(self._forked())
        if self.on_loop_thread and self.core.delivering and handle.request_id in self.core.handles:
            # From a listener: the state machine is consistent, cancel at once.
            return self.core.cancel(handle.request_id)
        # Anywhere else, the decode thread included: a finalizer run by the
        # garbage collector mid-tick must not reenter the state machine, so
        # the cancel waits in the inbox for the next drain (before the next tick).
        with self._wake:
            self._inbox.append(("cancel", handle, None))
            self._wake.notify()
        return True

    def set_pipelined(self, pipelined: bool | str) -> None:
        """Switch between pipelined (True), blocking (False) and per-tick
        ("auto") ticks. The decode thread owns the core, so the switch is
        made there, between two ticks; a caller on another thread returns
        once it is made."""
        if not (isinstance(pipelined, bool) or pipelined == "auto"):
            raise TypeError(f'pipelined must be True, False or "auto", got {shown(pipelined)}')
        if self.on_loop_thread:
            self.core.pipelined = pipelined
            return
        made = threading.Event()
        self.check_running()  # before the lock: see submit_all
        with self._wake:
            self.check_running()
            self._inbox.append(("pipelined", pipelined, made))
            self._wake.notify()
        # The decode thread sets ``made`` even when it stops on an error; this
        # looks again only in case it ended some other way, so nobody waits for ever.
        while not made.wait(ALIVE_POLL):
            if not self._thread.is_alive() and not made.is_set():
                raise EngineStopped("the engine's decode thread has ended; the switch was not made")

    def close(self, wait: bool = True) -> None:
        """Stop taking work, cancel what is live, and end the thread. From the
        decode thread (a listener) it only asks: the loop ends after the
        current delivery. The wait is bounded (``close_wait``): a listener
        that blocks holds the thread, and close warns rather than hang."""
        if os.getpid() != self._pid:  # a child of fork(): no thread to end, its lock may be held
            self._closed = True
            return
        with self._wake:
            self._closed = True
            self._wake.notify()
        if wait and not self.on_loop_thread:
            self._thread.join(timeout=self.close_wait)
            if self._thread.is_alive():
                warnings.warn(f"close(): the decode thread is still running after {self.close_wait:g} s, held "
                              "by a step or a listener that has not returned; it ends when that returns",
                              RuntimeWarning, stacklevel=3)
        if not self._thread.is_alive():  # nothing left for the exit hook to end
            atexit.unregister(self._at_exit)

    def stalled_for(self) -> float:
        """Seconds the decode thread has held requests without going round
        its loop once (a step or a listener that does not return), or 0:
        it is idle, or moving. Its thread is alive all the while, so only
        this tells a health probe that nothing will answer."""
        if not (self._live or self._inbox):  # sizes read without the lock: atomic, and a probe's guess
            return 0.0
        return max(0.0, time.monotonic() - self._moved)

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return (os.getpid() == self._pid and self._thread.is_alive() and not self._closed
                and self._error is None)

    def _forked(self) -> str:
        return f"the engine was built in process {self._pid}; a child of fork() must build its own"

    def refuse_wait_on_loop_thread(self, what: str) -> None:
        """Refuse a wait nothing would end: on the decode thread (a listener),
        or in a child of fork(), which has no decode thread."""
        if os.getpid() != self._pid:
            raise EngineStopped(f"{what}: {self._forked()}")
        if self.on_loop_thread:
            raise RuntimeError(f"{what} was called on the decode thread (from a listener or a skill's "
                               "hook): it would wait for the thread running it. Listeners and hooks must "
                               "not block; keep state and return, or wait from another thread.")

    def check_running(self) -> None:
        if os.getpid() != self._pid:
            raise EngineStopped(self._forked())
        if self._error is not None:
            raise EngineStopped(f"the engine has stopped: {described(self._error)}")
        if self._closed:
            raise EngineStopped("the engine is closed")
        if not self._thread.is_alive():
            raise EngineStopped("the engine's decode thread has ended")

    # -------------------------------------------------------- decode thread
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    idle = not (self._inbox or self._closed or self.core.has_work())
                    while not (self._inbox or self._closed or self.core.has_work()):
                        self._wake.wait()
                    self._moved = time.monotonic()  # idle is not stalled
                if idle:
                    self._gather()
                with self._wake:
                    while self._inbox:  # popleft: a finalizer may append meanwhile
                        self._taking.append(self._inbox.popleft())
                    self._arriving = 0
                    closing = self._closed
                while self._taking:
                    self._take(*self._taking.popleft())
                if closing:
                    self._shut_down()
                    return
                if self.core.has_work():
                    self.core.tick()
                self._moved = time.monotonic()
        except BaseException as err:  # noqa: BLE001 - a bug or a lost device: end everyone, name it
            self._stop(err)

    def _gather(self) -> None:
        """Woken from idle by a submit: let the other threads submitting at the
        same moment (clients whose requests ended in one step, say) get theirs
        in, so they share the first prefill instead of trickling into several.
        Yields the GIL while the inbox keeps growing; a caller alone costs a
        yield or two, and nothing waits on a clock."""
        seen = -1
        for _ in range(GATHER_YIELDS):
            with self._wake:
                now = len(self._inbox)
            if now == seen:
                return
            seen = now
            time.sleep(0)

    def _take(self, kind: str, handle, listener: Listener | None) -> None:
        if kind == "cancel":
            self.core.cancel(handle.request_id)
            return
        if kind == "pipelined":
            self.core.pipelined = handle
            listener.set()
            return
        self._live[handle.request_id] = handle
        if listener is not None:
            self._listeners[handle.request_id] = listener
        try:
            core_handle = self.core.submit(handle.request, request_id=handle.request_id)
        except Exception as err:  # noqa: BLE001 - validated at the door; if the core still refuses, say so
            self._end_stragglers(f"refused: {described(err)}", (handle,))
            return
        core_handle.listeners.append(self._forward(handle))
        if listener is not None:
            core_handle.listeners.append(lambda _, token: listener(handle, token))

    def _forward(self, handle: Handle) -> Callable:
        def forward(core_handle, token: int | None) -> None:
            if token is None:
                self._live.pop(handle.request_id, None)
                self._listeners.pop(handle.request_id, None)  # the core tells it, next
            handle._push(token, core_handle.result if token is None else None)
        return forward

    def _shut_down(self) -> None:
        """Everything accepted ends (cancelled), in-flight steps commit, and
        every page and row slot comes back before the thread ends."""
        for request_id in list(self.core.handles):
            self.core.cancel(request_id)
        self.core.run_until_idle(max_ticks=10_000)
        self._end_stragglers("the engine closed before this request ended")

    def _stop(self, err: BaseException) -> None:
        with self._wake:
            self._error = err
            late = [*self._taking, *self._inbox]
            self._inbox.clear()
            self._arriving = 0
        reason = f"engine error: {described(err)}"
        for kind, handle, made in late:
            if kind == "submit":  # accepted: it ends, failed, like every live one
                self._live[handle.request_id] = handle
                if made is not None:
                    self._listeners[handle.request_id] = made
            elif kind == "pipelined":
                made.set()  # nothing waits forever
        try:
            self.core.abort(reason)
        except BaseException:  # noqa: BLE001 - the core is broken; end the handles directly
            pass
        try:
            self._end_stragglers(reason)
        except (KeyboardInterrupt, SystemExit):  # the engine is stopping already, its first error named
            pass

    def _end_stragglers(self, reason: str, handles=None) -> None:
        """I7 at the edge: a handle the core could not end gets its Result here.
        A listener asking the process to stop is obeyed only once every
        straggler has ended and been told: raised at once, it left the rest,
        and whoever waited on them, waiting for ever."""
        stop: BaseException | None = None
        for handle in list(self._live.values()) if handles is None else handles:
            self._live.pop(handle.request_id, None)
            listener = self._listeners.pop(handle.request_id, None)
            if not handle.done:
                handle._push(None, Result(request_id=handle.request_id, status=Status.FAILED,
                                          tokens=handle.tokens, finish_reason=reason,
                                          tag=handle.request.tag))
                if listener is not None:  # its end, as the core would have told it
                    try:
                        returned = listener(handle, None)
                        if returned is not None and inspect.isawaitable(returned):
                            closed(returned)  # as the core closes it; the request has ended
                    except (KeyboardInterrupt, SystemExit) as err:
                        stop = stop or err
                    except BaseException:  # noqa: BLE001 - the request has ended; nothing more to fail
                        pass
        if stop is not None:
            raise stop
