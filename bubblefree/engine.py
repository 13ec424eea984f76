"""What users import: a model, its skills, and a decode loop, in one object.

    engine = Engine.from_pretrained()                 # the embedded default model
    engine.query("What is the capital of France?")    # {"answer": "..."}
    for text in engine.stream("query", question="Why is the sky blue?"):
        print(text, end="")
    await engine.arun("detect", object="cat")         # asyncio

Every call may come from any thread; concurrent calls batch together in the
same decode steps. Bad arguments raise ``InvalidRequest`` naming the field,
and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, AsyncIterator, Iterator

from bubblefree.core import Engine as CoreEngine
from bubblefree.core import Handle, Result, SamplingParams, Status
from bubblefree.skills import SkillSet, TextStream

from bubblefree.loop import ServingLoop

_END = object()


class RequestFailed(RuntimeError):
    def __init__(self, result: Result):
        super().__init__(f"request {result.request_id} {result.status.value}: {result.finish_reason}")
        self.result = result


class Engine:
    def __init__(self, core: CoreEngine, skills: SkillSet, *, backend: Any = None):
        self.core = core
        self.skills = skills
        self.backend = backend
        self.loop = ServingLoop(core)

    @classmethod
    def from_pretrained(cls, path_or_default: str | None = None, *, device: str | None = None,
                        pipelined: bool = True, dtype: Any = None, **backend_options: Any) -> "Engine":
        """Load a decoder (a directory, a ``.gguf`` file, or ``None`` for the
        embedded SmolLM2-135M-Instruct), add the skills' location tokens,
        build the CUDA backend (CPU without a GPU), compile the skills."""
        from bubblefree.build import build_engine  # torch is imported only here

        return build_engine(cls, path_or_default, device=device, pipelined=pipelined,
                            dtype=dtype, **backend_options)

    # ------------------------------------------------------------ submitting
    def submit(self, skill: str, *, sampling: SamplingParams | None = None,
               max_tokens: int | None = None, listener=None, **args: Any) -> Handle:
        request = self.skills.request(skill, max_tokens=max_tokens,
                                      sampling=sampling or SamplingParams(),
                                      max_context=self.core.backend.capacity.max_context, **args)
        return self.loop.submit(request, listener)

    def run(self, skill: str, **args: Any) -> dict:
        """Blocking: the skill's result (``{"answer": ...}``, ``{"points": ...}``...)."""
        done = threading.Event()
        handle = self.submit(skill, listener=lambda h, t: done.set() if t is None else None, **args)
        done.wait()
        return _output(handle.result)

    def query(self, question: str, **kw: Any) -> dict:
        return self.run("query", question=question, **kw)

    def caption(self, length: str = "normal", **kw: Any) -> dict:
        return self.run("caption", length=length, **kw)

    def point(self, object: str, **kw: Any) -> dict:  # noqa: A002 - Moondream's argument name
        return self.run("point", object=object, **kw)

    def detect(self, object: str, **kw: Any) -> dict:  # noqa: A002
        return self.run("detect", object=object, **kw)

    def segment(self, object: str, **kw: Any) -> dict:  # noqa: A002
        return self.run("segment", object=object, **kw)

    # -------------------------------------------------------------- streaming
    def stream(self, skill: str = "query", **args: Any) -> Iterator[str]:
        """Text pieces as tokens are committed (query, caption)."""
        pieces: queue.Queue = queue.Queue()
        self.submit(skill, listener=lambda h, t: pieces.put(_END if t is None else t), **args)
        text = TextStream(self.skills.tokenizer, self._stop_ids())
        while (item := pieces.get()) is not _END:
            piece = text.push([item])
            if piece:
                yield piece

    def stream_query(self, question: str, **kw: Any) -> Iterator[str]:
        return self.stream("query", question=question, **kw)

    # ---------------------------------------------------------------- asyncio
    async def arun(self, skill: str, **args: Any) -> dict:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def listener(handle: Handle, token: int | None) -> None:
            if token is None:
                loop.call_soon_threadsafe(_settle, future, handle.result)

        self.submit(skill, listener=listener, **args)
        return _output(await future)

    async def aquery(self, question: str, **kw: Any) -> dict:
        return await self.arun("query", question=question, **kw)

    async def astream(self, skill: str = "query", **args: Any) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        self.submit(skill, listener=lambda h, t: loop.call_soon_threadsafe(
            pieces.put_nowait, _END if t is None else t), **args)
        text = TextStream(self.skills.tokenizer, self._stop_ids())
        while (item := await pieces.get()) is not _END:
            piece = text.push([item])
            if piece:
                yield piece

    # ------------------------------------------------------------------ misc
    def close(self) -> None:
        self.loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stop_ids(self) -> frozenset[int]:
        return frozenset({self.skills.tokenizer.eos_id})


def _settle(future: asyncio.Future, result: Result) -> None:
    if not future.done():
        future.set_result(result)


def _output(result: Result) -> dict:
    if result.status is not Status.COMPLETED:
        raise RequestFailed(result)
    return result.output
