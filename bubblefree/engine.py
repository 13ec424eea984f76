"""What users import: a model, its skills, and a decode loop, in one object.

    engine = Engine.from_pretrained()                 # the embedded default model
    engine.query("What is the capital of France?")    # {"answer": "..."}
    for text in engine.stream("query", question="Why is the sky blue?"):
        print(text, end="")

    engine = Engine.from_pretrained("path/to/moondream2")   # a local checkpoint
    engine.point("photo.jpg", "cat")                  # {"points": [{"x": ..., "y": ...}]}
    await engine.adetect(image, "cat")                # asyncio

The skills' calls in moondream's signatures, image first, are in
``bubblefree/calls.py``; ``submit``, ``run``, ``stream``, ``arun`` and
``astream`` take any skill's arguments, ``image=`` included.

Every call may come from any thread; concurrent calls batch together in the
same decode steps. Bad arguments raise ``InvalidRequest`` naming the field,
and the engine keeps serving. A call that does not complete raises
``RequestFailed`` (streams too, at their end), so a cut answer never passes
for a whole one. Whatever stops waiting for a request cancels it: an
awaiting task that is cancelled, a stream closed or dropped half-read, a
``KeyboardInterrupt`` in one of the engine's own blocking calls (``run``,
``query``, ``caption``, ``point``, ``detect``, ``segment``, or a read of a
``stream``). A ``Handle`` from ``submit`` is the caller's: a
``KeyboardInterrupt`` in its ``result()`` or its iteration leaves the
request running, for ``handle.cancel()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

from bubblefree.call_checks import check_listener, each_call, lone, named
from bubblefree.calls import SkillCalls
from bubblefree.core import Engine as CoreEngine
from bubblefree.core import InvalidRequest, Request, SamplingParams
from bubblefree.core.values import shown
from bubblefree.encoded import EncodedImage, ImageIntake
from bubblefree.handle import Handle, RequestFailed
from bubblefree.images import DEFAULT_MAX_PIXELS
from bubblefree.loop import EngineStopped, Listener, ServingLoop, check_undriven
from bubblefree.skills import SkillSet
from bubblefree.skills.registry import BUILTIN, Registry
from bubblefree.skills.skillset import output_room
from bubblefree.streams import AsyncPieces, AsyncTextStream, TextPieces

__all__ = ["EncodedImage", "Engine", "EngineStopped", "Handle", "RequestFailed"]


class Engine(SkillCalls):
    def __init__(self, core: CoreEngine, skills: SkillSet, *, backend: Any = None,
                 max_image_pixels: int = DEFAULT_MAX_PIXELS):
        check_undriven(core)  # before compiling, which registers masks on it
        self.core = core
        # Compiled here, before the decode thread starts: compiling walks the
        # vocabulary and registers masks, which on the CUDA backend may
        # rebuild the mask table and re-capture sampling graphs; done lazily
        # it ran on a caller's thread while the decode thread served.
        self._skills = skills.compile_all()
        check_masks_on(core, self._skills)
        self.backend = backend
        self.images = ImageIntake(core.backend, max_image_pixels)
        self.loop = ServingLoop(core)
        # Dropped without close(), the engine still ends its thread, and with
        # it the model and the KV cache: the loop holds no reference back here.
        self._finalizer = weakref.finalize(self, self.loop.close, False)

    @property
    def skills(self) -> SkillSet:
        """The skill set this engine was built with, compiled. Read-only: a
        skill of your own is registered at construction (``registry=``)."""
        return self._skills

    @classmethod
    def from_pretrained(cls, path_or_default: str | None = None, *, device: str | None = None,
                        pipelined: bool | str = "auto", dtype: Any = None, registry: Registry = BUILTIN,
                        **backend_options: Any) -> "Engine":
        """Load a model (a directory, a ``.gguf`` file, or ``None`` for the
        embedded SmolLM2-135M-Instruct), build the CUDA backend (CPU without a
        GPU), compile the skills. A local moondream2 checkpoint directory
        (config.json, .safetensors, tokenizer.json) gives an engine that
        answers about images, with its region head and prompt templates; a
        transformers LLaVA, LLaVA-NeXT, Idefics3, SmolVLM2, PaliGemma,
        Qwen2-VL or Qwen2.5-VL checkpoint one that captions and answers about them
        (``docs/vlm.md``). ``location_tokens=True`` adds the spatial skills'
        location tokens to a text model (point, detect and segment need
        them, or a region head); ``max_image_pixels`` bounds an image's
        pixels (decompression bombs); ``registry`` is the skills served
        (``BUILTIN.with_skill(MySkill())`` adds yours); options are checked
        before loading."""
        from bubblefree.build import build_engine  # torch is imported only here

        return build_engine(cls, path_or_default, device=device, pipelined=pipelined,
                            dtype=dtype, registry=registry, **backend_options)

    @classmethod
    def moondream_random(cls, config: Any = "tiny", *, device: str | None = None, seed: int = 0,
                         pipelined: bool | str = "auto", dtype: Any = None, tokenizer: Any = None,
                         registry: Registry = BUILTIN, **backend_options: Any) -> "Engine":
        """moondream2 with random weights from ``seed``, for tests and
        benchmarks: ``config`` is ``"tiny"`` (small widths, moondream2's image
        geometry; runs on a CPU), ``"full"`` (moondream2's shapes) or a
        ``MoondreamConfig``. The tokenizer is a small word-level one unless a
        ``tokenizers.Tokenizer`` is given. Its answers are noise; its shapes,
        images, values and timings are moondream2's. ``registry``: as in
        ``from_pretrained``."""
        from bubblefree.build import build_moondream, random_config

        return build_moondream(cls, random_config(config), device=device, pipelined=pipelined,
                               dtype=dtype, seed=seed, tokenizer=tokenizer, registry=registry,
                               **backend_options)

    # ------------------------------------------------------------ submitting
    def submit(self, skill: str, *, sampling: SamplingParams | dict | None = None,
               max_tokens: int | None = None, listener: Callable[[Handle, int | None], None] | None = None,
               **args: Any) -> Handle:
        """Accept a request and return its ``Handle`` at once. ``listener(handle,
        token)`` runs on the decode thread after each tick that committed a
        token for it, then once with ``None``; it must not block, and if it
        raises, its request fails (with the error named) and nothing else
        (but ``KeyboardInterrupt`` and ``SystemExit``, which stop the engine,
        every request failing with it named). A live Handle keeps its engine
        serving until the request ends, however the engine is referenced."""
        args = dict(args, sampling=sampling, max_tokens=max_tokens, listener=listener)
        try:
            return self.submit_many([(skill, args)])[0]  # the one door every request goes through
        except InvalidRequest as err:
            raise lone(err) from None

    def submit_many(self, calls: Iterable[tuple[str, dict[str, Any]]]) -> list[Handle]:
        """``submit`` for several ``(skill, arguments)`` at once: all are checked
        first (one bad call refuses them all, naming it, ``calls[2].question:
        ...``; none of them is submitted), then handed to the decode thread
        together, so they share their first prefill."""
        items = [self._call_item(i, call) for i, call in enumerate(each_call(calls))]
        handles = self.loop.submit_all(items)  # validates all before accepting any
        for handle in handles:
            handle._keep_until_done(self)  # the engine closes when collected; not under a live request
        return handles

    def _call_item(self, i: int, call: Any) -> tuple[Request, Listener | None]:
        """``submit_many``'s call ``i`` checked whole, every refusal named
        ``calls[i]``: in a batch a bare ``question: ...`` names no call."""
        if not (isinstance(call, (tuple, list)) and len(call) == 2 and isinstance(call[1], Mapping)):
            raise InvalidRequest(f"calls[{i}]: must be a (skill, arguments) pair with the arguments a "
                                 f"mapping, got {call!r:.80}")
        skill, args = call
        for key in args:
            if not isinstance(key, str):
                raise InvalidRequest(f"calls[{i}]: argument names must be strings, got {key!r:.80}")
        try:
            item = self._item(skill, dict(args))
            # The core's checks, here to be named; ``submit_all`` repeats
            # them (pure and cheap), unnamed, for its own callers.
            self.core.validate(item[0])
        except InvalidRequest as err:  # its cause: what ``submit`` raises for a lone call
            raise InvalidRequest(named(i, err)) from err
        return item

    def _item(self, skill: str, args: dict[str, Any]) -> tuple[Request, Listener | None]:
        """One call's ``(request, listener)``, its arguments checked; ``args`` is consumed."""
        listener, sampling = args.pop("listener", None), args.pop("sampling", None)
        check_listener(listener)
        # A request without a seed gets its own here, so that its Handle shows it.
        sampling = SamplingParams.of(sampling).seeded(self.core.fresh_seed)
        return self._request(skill, sampling, args), listener

    def _request(self, skill: str, sampling: SamplingParams, args: dict[str, Any]):
        # The engine's own keywords to the skill set: a caller's would collide.
        if clash := sorted(ENGINE_SETS.intersection(args)):
            raise InvalidRequest(f"{clash[0]}: unknown argument; the engine sets it (skill {shown(skill)})")
        if args.get("image") is not None:
            self.skills.tables(skill)  # an unknown or unserved skill is refused before the image is read
            args["image"] = self.images.ref(args["image"])
        return self.skills.request(skill, sampling=sampling, **self._bounds(), **args)

    def output_room(self, prompt_len: int) -> int | None:
        """Output tokens that fit after a prompt of ``prompt_len`` positions
        (an image's included), as ``submit`` counts them: under 1, such a
        prompt is refused as too long. None: nothing bounds it."""
        return output_room(prompt_len, **self._bounds())[0]

    def _bounds(self) -> dict[str, int | None]:
        cap = self.core.backend.capacity
        return {"max_context": cap.max_context, "max_positions": cap.num_pages * cap.page_size}

    def cancel(self, request: Handle) -> bool:
        """Cancel ``request`` (its Handle) from any thread; see ``Handle.cancel``."""
        if not isinstance(request, Handle):
            raise TypeError(f"cancel takes the Handle that submit returned, not {type(request).__name__}")
        return request.cancel()

    def run(self, skill: str, **args: Any) -> dict:
        """Blocking: the skill's result (``{"answer": ...}``, ``{"points": ...}``...)."""
        self.loop.refuse_wait_on_loop_thread(f"Engine.run({shown(skill)})")
        handle = self.submit(skill, **args)
        try:
            return handle.output()
        except BaseException:  # KeyboardInterrupt, or RequestFailed: stop its work either way
            handle.cancel()
            raise

    # -------------------------------------------------------------- streaming
    def stream(self, skill: str = "query", **args: Any) -> TextPieces:
        """Text pieces as tokens are committed (query, caption). The request is
        submitted now (bad arguments raise here); closing or dropping the
        stream cancels it; ``RequestFailed`` ends a stream that did not complete."""
        self.loop.refuse_wait_on_loop_thread("Engine.stream")
        return TextPieces(self.submit(skill, **args), self.skills.tokenizer)

    # ---------------------------------------------------------------- asyncio
    async def arun(self, skill: str, **args: Any) -> dict:
        # An event loop on the decode thread was started by a hook or a
        # listener (``asyncio.run`` inside one): awaited there, nothing
        # would ever settle the answer.
        self.loop.refuse_wait_on_loop_thread(f"Engine.arun({shown(skill)})")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_event(handle: Handle, token: int | None) -> None:
            if token is None:
                _call_soon(loop, _settle, done, handle)
            elif loop.is_closed():  # nobody can await the answer any more
                handle.cancel()

        args = await self._aimage(skill, args)
        handle = self.submit(skill, listener=_chained(on_event, args.pop("listener", None)), **args)
        try:
            await done
        finally:  # cancelled, or the event loop went away: stop the request's work
            if not handle.done:
                handle.cancel()
        return handle.output(0)

    async def astream(self, skill: str = "query", **args: Any) -> AsyncIterator[str]:
        """``stream`` for asyncio: an async iterator of text pieces; closing it,
        or cancelling the task iterating it, cancels the request."""
        self.loop.refuse_wait_on_loop_thread("Engine.astream")
        args = await self._aimage(skill, args)
        pieces = AsyncTextStream(asyncio.get_running_loop(), self.skills.tokenizer)
        handle = self.submit(skill, listener=_chained(pieces.listener, args.pop("listener", None)), **args)
        # Closed at once when this generator is: left to the garbage collector,
        # the inner one (and its cancel) would wait for a later loop turn, or
        # for ever once the event loop is gone.
        async with contextlib.aclosing(pieces.run(handle)) as run:
            async for piece in run:
                yield piece

    async def astream_now(self, skill: str = "query", **args: Any) -> AsyncPieces:
        """``astream``, submitted now: bad arguments raise at the await, and
        the request runs whether or not the pieces are read yet."""
        self.loop.refuse_wait_on_loop_thread("Engine.astream_now")
        args = await self._aimage(skill, args)
        pieces = AsyncTextStream(asyncio.get_running_loop(), self.skills.tokenizer)
        handle = self.submit(skill, listener=_chained(pieces.listener, args.pop("listener", None)), **args)
        return AsyncPieces(handle, pieces)

    # ------------------------------------------------------------------ misc
    @property
    def takes_images(self) -> bool:
        """Whether the model answers about images (its backend runs image prefills)."""
        return self.images.takes_images

    @property
    def pipelined(self) -> bool | str:
        """"auto" (the default: each tick launches ahead of the pending commit
        or not, whichever the core expects to be faster), True (always
        ahead), or False (the blocking baseline). Outputs are the same (I8)."""
        return self.core.pipelined

    @pipelined.setter
    def pipelined(self, value: bool | str) -> None:
        self.loop.set_pipelined(value)

    def close(self) -> None:
        """Cancel what is live, let in-flight steps finish, end the decode
        thread. From a listener it only asks; the thread ends after it."""
        self.loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# What ``_request`` hands ``SkillSet.request`` itself, besides the skill's name.
ENGINE_SETS = frozenset({"name", "max_context", "max_positions"})


def check_masks_on(core: CoreEngine, skills: SkillSet) -> None:
    """Refuse a skill set whose masks are not this core's: one compiled for
    another engine's core registered its masks there, and compiles no more,
    so here every constrained request failed on an unknown mask id, or,
    where this core had masks of its own under the same ids, sampled under
    the wrong sets."""
    stray = [mask_id for mask_id, allowed in skills.registered().items()
             if core.masks.get(mask_id) != allowed]
    if stray:
        raise ValueError(f"skills: compiled for another engine's core (its mask {stray[0]} is not this "
                         f"core's); build a SkillSet with this core's register_mask")


def _chained(ours: Callable, theirs: Callable | None) -> Callable:
    """Our listener, then the caller's own (``listener=`` is accepted by the
    asyncio calls too); ours never raises, so theirs raising fails the request
    as it would anywhere else."""
    check_listener(theirs)
    if theirs is None:
        return ours

    def both(handle: Handle, token: int | None) -> None:
        ours(handle, token)
        theirs(handle, token)
    return both


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> bool:
    """``call_soon_threadsafe``, False when the event loop is closed (its
    awaiting code is gone; the caller's cleanup cancels the request)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(future: asyncio.Future, handle: Handle) -> None:
    if not future.done():
        future.set_result(None)
