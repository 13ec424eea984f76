"""Streams of text pieces over a Handle: blocking and asyncio.

Both own their request: whoever stops reading cancels it. A blocking
stream cancels on ``close()``, on leaving a ``with`` block, or when it is
garbage-collected half-read (even never started); an async stream cancels
when it is closed, when the task iterating it is cancelled, or when its
event loop is gone. Both raise ``RequestFailed`` at the end when the
request was cancelled or failed: a cut answer never passes for a whole
one, also when it is read on after a close or an interrupted read (the
rest of what was committed, then ``RequestFailed``).

One reader at a time: a read begun while another thread (task) is inside
one raises ``RuntimeError`` at once and touches nothing, so the misuse
neither cancels the first reader's request nor takes its pieces.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref
from typing import Any, AsyncIterator, Iterator

from bubblefree.core import Status
from bubblefree.handle import Handle, RequestFailed
from bubblefree.skills import TextStream


class OneReader:
    """Held for the length of one read (a ``with`` block). The reads that
    would collide are refused here, before the stream's own error handling
    sees them: that handling takes any error for its reader's own, and cancels
    the request, which would cut the answer of the reader already inside."""

    def __init__(self, reader: str):
        self._lock = threading.Lock()  # threads and event loops alike
        self._reader = reader  # "thread" or "task", for the message

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"stream: already being read by another {self._reader}; read a stream "
                               f"from one {self._reader} at a time (this read took nothing)")

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


class TextPieces:
    """An iterator of text pieces; a context manager too."""

    def __init__(self, handle: Handle, tokenizer: Any):
        self.handle = handle
        self._tokens: Iterator[int] = iter(handle)
        self._text = TextStream(tokenizer, handle.request.stop_ids)
        self._cancel = weakref.finalize(self, handle.cancel)
        self._failed: RequestFailed | None = None  # raised again on every later read
        self._seen = 0  # tokens read
        self._reading = OneReader("thread")

    def __iter__(self) -> "TextPieces":
        return self

    def __next__(self) -> str:
        # From a listener, a read of a live request could wait for the thread
        # running it: refused here, before the read, whose error handling
        # would take the refusal for an interrupted read and cancel the
        # request, cutting its own reader's answer. Refused whether or not a
        # token is there yet, so the answer does not depend on timing.
        if not self.handle.done:
            self.handle._loop.refuse_wait_on_loop_thread("reading a stream")
        with self._reading:
            return self._next()

    def _next(self) -> str:
        if self._failed is not None:
            raise self._failed
        try:
            for token in self._tokens:
                self._seen += 1
                piece = self._text.push([token])
                if piece:
                    return piece
        except BaseException as err:  # RequestFailed, or an interrupt while waiting
            self.close()
            if isinstance(err, RequestFailed):
                self._failed = err
            else:  # the interrupted iterator is spent: later reads go on from the handle
                self._tokens = itertools.islice(iter(self.handle), self._seen, None)
            raise
        self._cancel.detach()  # completed: nothing to cancel
        piece = self._text.flush()  # the tail held back as an incomplete character
        if piece:
            return piece
        raise StopIteration

    def close(self) -> None:
        """Stop reading: the request is cancelled if it is still running."""
        self._cancel()

    def __enter__(self) -> "TextPieces":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncTextStream:
    """Tokens handed from the decode thread to one asyncio event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer: Any):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tokenizer = tokenizer
        self._text: TextStream | None = None  # the pieces' decoder, from run()
        self._seen = 0  # tokens made into pieces

    @property
    def seen(self) -> int:
        """The tokens made into the pieces read so far."""
        return self._seen

    def listener(self, handle: Handle, token: int | None) -> None:
        """Runs on the decode thread. With the event loop closed nobody can
        read any more: the request is cancelled rather than left running."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, token)
        except RuntimeError:
            handle.cancel()

    async def run(self, handle: Handle) -> AsyncIterator[str]:
        self._text = text = TextStream(self._tokenizer, handle.request.stop_ids)
        try:
            while asyncio.get_running_loop() is self._loop:
                if (token := await self._queue.get()) is None:
                    break
                self._seen += 1
                if piece := text.push([token]):
                    yield piece
            else:  # read in another loop (its own closed, say): no token reaches it
                async for piece in self.rest(handle):
                    yield piece
                return
        finally:  # closed, cancelled, or raised: stop the request's work
            if not handle.done:
                handle.cancel()
        result = handle.result(0)
        if result.status is not Status.COMPLETED:
            raise RequestFailed(result)
        if tail := text.flush():  # held back as an incomplete character
            yield tail

    async def rest(self, handle: Handle) -> AsyncIterator[str]:
        """What ``run`` has not read yet, from the handle once the request
        has ended (waited for off the event loop): read on after ``run`` was
        closed or interrupted, or in another event loop than the stream's,
        which the listener's tokens never reach."""
        result = await asyncio.get_running_loop().run_in_executor(None, handle.result)
        text = self._text or TextStream(self._tokenizer, handle.request.stop_ids)
        fresh, self._seen = result.tokens[self._seen:], len(result.tokens)
        if fresh and (piece := text.push(list(fresh))):
            yield piece
        if result.status is not Status.COMPLETED:
            raise RequestFailed(result)
        if tail := text.flush():
            yield tail


class AsyncPieces:
    """An async iterator of text pieces for a request already submitted (the
    asyncio calls' ``stream=True``): closing it, cancelling the task reading
    it, or dropping it unread cancels the request."""

    def __init__(self, handle: Handle, stream: AsyncTextStream):
        self.handle = handle
        self._stream = stream
        self._pieces: AsyncIterator[str] = stream.run(handle)
        self._cancel = weakref.finalize(self, handle.cancel)
        self._failed: RequestFailed | None = None  # raised again on every later read
        self._reading = OneReader("task")

    def __aiter__(self) -> "AsyncPieces":
        return self

    async def __anext__(self) -> str:
        with self._reading:
            return await self._next()

    async def _next(self) -> str:
        if self._failed is not None:
            raise self._failed
        try:
            return await self._pieces.__anext__()
        except StopAsyncIteration:
            self._cancel.detach()  # completed: nothing to cancel
            raise
        except BaseException as err:  # RequestFailed, or the read was cancelled
            await self.aclose()
            if isinstance(err, RequestFailed):
                self._failed = err
            raise

    async def aclose(self) -> None:
        """Stop reading: the request is cancelled if it is still running. A
        later read gets the rest of what was committed, then
        ``RequestFailed`` if the request was cut. From another task while
        one reads: that read ends with the rest and ``RequestFailed``."""
        try:
            # A generator another task is inside cannot be closed from here
            # ("already running"); the cancel below ends that read instead.
            if not getattr(self._pieces, "ag_running", False):
                await self._pieces.aclose()  # type: ignore[attr-defined]
        finally:
            self._cancel()
            self._pieces = self._stream.rest(self.handle)
