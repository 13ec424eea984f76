"""Engine requests as the routes use them: submitted from a worker thread
(tokenizing is slow for a large prompt), read as text pieces on the
server's event loop, cancelled when the reader stops.

Moondream's routes call their skill through ``Engine.submit``; OpenAI's
carry a whole prompt (a conversation, or raw text for completions) and call
the ``complete`` skill, which takes a prompt framed already.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable, Iterator

import attrs

from bubblefree.core import ImageRef, InvalidRequest, SamplingParams
from bubblefree.core.values import message
from bubblefree.engine import Engine
from bubblefree.handle import Handle
from bubblefree.skills.templates import templates_of
from bubblefree.skills.tokenizer import check_user_text
from bubblefree.streams import AsyncTextStream

@attrs.define
class Run:
    handle: Handle
    pieces: AsyncIterator[str]
    stream: AsyncTextStream | None = None  # what made ``pieces``
    read: int | None = None  # tokens read when a stop string ended the text

    @property
    def prompt_tokens(self) -> int:
        """The prompt's positions, an image's included: what the request
        takes of the context, as OpenAI counts an image in its usage."""
        return self.handle.request.prefix_len

    @property
    def completion_tokens(self) -> int:
        stop_ids = self.handle.request.stop_ids
        tokens = self.handle.tokens if self.read is None else self.handle.tokens[:self.read]
        return sum(1 for t in tokens if t not in stop_ids)

    def stop_seen(self) -> None:
        """A stop string ended the text. The tokens sampled after it, until
        the cancel lands (more or fewer as the decode thread runs ahead), never
        reach the client, so they are not counted."""
        if self.stream is not None:
            self.read = self.stream.seen


async def run_skill(engine: Engine, skill: str, **args: Any) -> Run:
    stream = AsyncTextStream(asyncio.get_running_loop(), engine.skills.tokenizer)
    handle = await _submitted(lambda: engine.submit(skill, listener=stream.listener, **args))
    return Run(handle, stream.run(handle), stream)


async def _submitted(submit: Callable[[], Handle]) -> Handle:
    """``submit()`` in a worker thread: it tokenizes the prompt, which for
    one of megabytes takes seconds that would stall every other client on
    the event loop. Cancelled while it runs (the server shutting down), the
    caller leaves at once and the request, once in, is cancelled: nobody
    will read it."""
    job = asyncio.ensure_future(asyncio.to_thread(submit))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(_cancel_orphan)
        raise


def _cancel_orphan(job: asyncio.Future) -> None:
    if not job.cancelled() and job.exception() is None:
        job.result().cancel()


async def run_prompt(engine: Engine, prompt: list[int], max_tokens: int | None, sampling: dict,
                     image: ImageRef | None = None) -> Run:
    """A prompt framed already (a conversation, raw text), about ``image`` if
    given: the ``complete`` skill, through the same door and the same checks
    as every request."""
    return await run_skill(engine, "complete", prompt=prompt, max_tokens=max_tokens,
                           sampling=SamplingParams.of(sampling), image=image)


def chat_prompt(tokenizer: Any, messages: list[tuple[str, str]], image_in: int | None = None) -> list[int]:
    """A conversation as prompt ids: through the model's chat template where
    it has one; moondream's query template (each user turn a question, each
    assistant turn its answer) where the model has those; otherwise in the
    Question/Answer frame the skills use. On a vision-language model with a
    chat template (``image_turn``), message ``image_in`` holds the image
    and the ids are those after it (its prefix holds the ones before)."""
    for i, (_, content) in enumerate(messages):  # what no turn may spell (HFTokenizer.check_user_text)
        _check_turn(tokenizer, content, f"messages[{i}].content")
    turn = getattr(tokenizer, "image_turn", None)
    if turn is not None:
        with _template_refusals():
            ids = tokenizer.chat([{"role": r, "content": ([{"type": "image"}] if i == image_in else [])
                                   + [{"type": "text", "text": c}]} for i, (r, c) in enumerate(messages)])
        return turn.check_text(ids) if image_in is None else turn.after(ids)
    templates = templates_of(tokenizer)
    if templates is not None:
        ids: list[int] = []
        for role, text in messages:
            if role == "user":
                ids += templates.query_prompt(tokenizer, text)
            else:  # an answer follows its question; a system turn stands as text
                ids += tokenizer.encode((" " if role == "assistant" else "") + text)
        return ids
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and getattr(hf, "chat_template", None):
        with _template_refusals():
            ids = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                         add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding in newer releases
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if len(messages) == 1 and messages[0][0] == "user":
        question = messages[0][1]
        return tokenizer.prompt(f"\n\nQuestion: {question}\n\nAnswer:", question)
    turns = {"system": "{}", "user": "\n\nQuestion: {}", "assistant": "\n\nAnswer: {}"}
    frame = "".join(turns[role].format(text) for role, text in messages) + "\n\nAnswer:"
    return tokenizer.encode(frame)


@contextlib.contextmanager
def _template_refusals() -> Iterator[None]:
    """A chat template's own refusal of a conversation (``raise_exception``:
    Gemma's of a system turn, Mistral's of turns that do not alternate) is
    the caller's to fix, not a server error: named as the prompt, which the
    chat route names ``messages``."""
    try:
        yield
    except Exception as err:
        try:
            from jinja2.exceptions import TemplateError
        except ImportError:  # no jinja2, no template: nothing of the template's raised
            raise err from None
        if not isinstance(err, TemplateError):
            raise
        raise InvalidRequest(f"prompt: the model's chat template refuses this conversation: "
                             f"{message(err)[:300]}") from None


def _check_turn(tokenizer: Any, text: str, field: str) -> None:
    """The tokenizer's refusal names ``prompt``, a field no chat client
    sends: here it names the message that holds the text."""
    try:
        check_user_text(tokenizer, text)
    except InvalidRequest as err:
        message = str(err)
        if not message.startswith("prompt:"):
            raise
        raise InvalidRequest(field + message[len("prompt"):]) from None


def finish_reason(run: Run, stopped: bool) -> str:
    """OpenAI's words: "length" when the budget ran out, else "stop"."""
    if stopped:  # a stop string ended it; the cancel that follows may still be on its way
        return "stop"
    return "length" if run.handle.result(0).finish_reason == "length" else "stop"
