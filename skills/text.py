"""Free-text skills: ``query`` and ``caption``.

Unconstrained but for one rule: spatial tokens are never sampled in text
(one mask, shared by both skills). EOS ends the text. ``TextStream`` turns
the committed tokens into text deltas for streaming.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from bubblefree.skills.base import (CompileContext, Skill, SkillError, SkillState, check_fields,
                         choice_arg, invalid, text_arg)
from bubblefree.skills.spatial_refs import spatial_refs_arg
from bubblefree.skills.templates import templates_of
from bubblefree.skills.tokenizer import Tokenizer


@attrs.frozen
class TextTables:
    mask: int
    allowed: frozenset[int]
    eos_id: int
    tokenizer: Tokenizer


def compile_text(ctx: CompileContext) -> TextTables:
    allowed = ctx.text_ids() | {ctx.eos_id}
    return TextTables(mask=ctx.mask(allowed), allowed=allowed, eos_id=ctx.eos_id,
                      tokenizer=ctx.tokenizer)


@attrs.define
class TextState(SkillState):
    tables: TextTables
    tokens: list[int] = attrs.Factory(list)
    consumed: int = 0
    done: bool = False

    def mask_id(self) -> int | None:
        return self.tables.mask

    def may_end(self) -> bool:
        return True  # EOS is allowed at every token

    def _step(self, token: int, value: float | None) -> None:
        if token == self.tables.eos_id:
            self.done = True
            return
        if token not in self.tables.allowed:
            raise SkillError(f"token {token} is spatial; free text excludes it")
        self.tokens.append(token)

    def text(self) -> str:
        return self.tables.tokenizer.decode(self.tokens).strip()


@attrs.frozen
class QueryArgs:
    question: str
    spatial_refs: tuple = ()  # skills.spatial_refs: points and boxes the question refers to


@attrs.frozen
class Query(Skill):
    """``query(question, spatial_refs=None)`` → ``{"answer": str}``."""

    name: str = "query"
    max_tokens: int = 512

    def parse_args(self, args: Mapping[str, Any]) -> QueryArgs:
        check_fields(self.name, args, ("question", "spatial_refs"))
        return QueryArgs(question=text_arg(self.name, args, "question"),
                         spatial_refs=spatial_refs_arg(self.name, args))

    def prompt(self, tokenizer: Tokenizer, args: QueryArgs) -> list[int]:
        return self._prompt(tokenizer, args)[0]

    def prompt_values(self, tokenizer: Tokenizer, args: QueryArgs) -> tuple:
        return self._prompt(tokenizer, args)[1]

    def _prompt(self, tokenizer: Tokenizer, args: QueryArgs) -> tuple[list[int], tuple]:
        templates = templates_of(tokenizer)
        if args.spatial_refs and (templates is None or not templates.takes_spatial_refs):
            raise invalid(self.name, "spatial_refs", "this model takes none: its tokenizer config names "
                          "no coord_id and size_id placeholders")
        if templates is not None:
            return templates.referring_query(tokenizer, args.question, args.spatial_refs)
        return tokenizer.prompt(f"\n\nQuestion: {args.question}\n\nAnswer:", args.question), ()

    def default_max_tokens(self, args: QueryArgs) -> int:
        return self.max_tokens

    def compile(self, ctx: CompileContext) -> TextTables:
        return compile_text(ctx)

    def start(self, tables: TextTables, args: QueryArgs, budget: int) -> TextState:
        return TextState(tables)

    def finish(self, state: TextState) -> dict[str, str]:
        return {"answer": state.text()}


CAPTION_LENGTHS = ("short", "normal", "long")


@attrs.frozen
class CaptionArgs:
    length: str


@attrs.frozen
class Caption(Skill):
    """``caption(length="short"|"normal"|"long")`` → ``{"caption": str}``."""

    name: str = "caption"

    def parse_args(self, args: Mapping[str, Any]) -> CaptionArgs:
        check_fields(self.name, args, ("length",))
        return CaptionArgs(choice_arg(self.name, args, "length", CAPTION_LENGTHS, "normal"))

    def prompt(self, tokenizer: Tokenizer, args: CaptionArgs) -> list[int]:
        templates = templates_of(tokenizer)
        if templates is not None:
            ids = templates.caption_prompt(args.length)
            if ids is None:
                raise invalid(self.name, "length", f"this model has no {args.length!r} caption; it has "
                              f"{', '.join(templates.captions)}")
            return ids
        ask = {"short": "Describe this image in one sentence.",
               "normal": "Describe this image.",
               "long": "Describe this image in detail."}[args.length]
        return tokenizer.prompt(f"\n\n{ask}\n\n", ask)

    def default_max_tokens(self, args: CaptionArgs) -> int:
        return {"short": 64, "normal": 256, "long": 768}[args.length]

    def compile(self, ctx: CompileContext) -> TextTables:
        return compile_text(ctx)

    def start(self, tables: TextTables, args: CaptionArgs, budget: int) -> TextState:
        return TextState(tables)

    def finish(self, state: TextState) -> dict[str, str]:
        return {"caption": state.text()}


@attrs.define
class TextStream:
    """Incremental detokenization for streaming.

    Decoding token by token breaks multi-token characters and spacing, so
    each push decodes a short window and emits only what became final: text
    ending in U+FFFD is an incomplete UTF-8 sequence and is held back.
    """

    tokenizer: Tokenizer
    stop_ids: frozenset[int] = frozenset()
    _tokens: list[int] = attrs.Factory(list)
    _prefix: int = 0  # window start: tokens before it are already emitted
    _read: int = 0  # tokens up to here are emitted

    def push(self, tokens: Sequence[int]) -> str:
        """Feed newly committed tokens; return the text they completed."""
        self._tokens.extend(t for t in tokens if t not in self.stop_ids)
        window = self._tokens[self._prefix:]
        before = self.tokenizer.decode(self._tokens[self._prefix:self._read])
        after = self.tokenizer.decode(window)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before):]

    def flush(self) -> str:
        """At the end of the answer: what the held-back tokens decode to, an
        incomplete character's U+FFFD included (the blocking answer, cut
        there by its token limit, holds it too)."""
        before = self.tokenizer.decode(self._tokens[self._prefix:self._read])
        after = self.tokenizer.decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return after[len(before):] if len(after) > len(before) else ""
