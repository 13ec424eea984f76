"""``complete``: free text after a prompt the caller framed itself.

The other skills frame their own prompts. A chat template's output, or raw
text for a completion, arrives framed already: this skill takes it as text
or as token ids and decodes free text after it, under the same mask and
rules as ``query`` (no spatial tokens; EOS ends it). OpenAI's routes serve
through it, so their requests enter by the same door as every other.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from bubblefree.core.values import shown
from bubblefree.skills.base import CompileContext, Skill, check_fields, invalid, text_arg
from bubblefree.skills.text import TextState, TextTables, compile_text
from bubblefree.skills.tokenizer import Tokenizer


@attrs.frozen
class CompleteArgs:
    text: str | None
    ids: tuple[int, ...] | None


@attrs.frozen
class Complete(Skill):
    """``complete(prompt=str | list[int])`` → ``{"text": str}``."""

    name: str = "complete"
    max_tokens: int = 512

    def parse_args(self, args: Mapping[str, Any]) -> CompleteArgs:
        check_fields(self.name, args, ("prompt",))
        value = args.get("prompt")
        if isinstance(value, str):
            return CompleteArgs(text=text_arg(self.name, args, "prompt"), ids=None)
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            return CompleteArgs(text=None, ids=tuple(value))
        raise invalid(self.name, "prompt", f"must be text or a non-empty list of token ids, got {_held(value)}")

    def prompt(self, tokenizer: Tokenizer, args: CompleteArgs) -> list[int]:
        if args.ids is None:
            return list(tokenizer.encode(args.text))
        # The caller's ids, refused as theirs: past here an id outside the
        # vocabulary is the skill's bug (``SkillSet.request``).
        outside = [t for t in args.ids if not 0 <= t < len(tokenizer)]
        if outside:  # ``shown``: a huge one by its digits (past 4,300 of them str() raises)
            raise invalid(self.name, "prompt", f"token ids must be ints in [0, {len(tokenizer)}), "
                          f"got {shown(outside[0])}")
        return list(args.ids)

    def default_max_tokens(self, args: CompleteArgs) -> int:
        return self.max_tokens

    def compile(self, ctx: CompileContext) -> TextTables:
        return compile_text(ctx)

    def start(self, tables: TextTables, args: CompleteArgs, budget: int) -> TextState:
        return TextState(tables)

    def finish(self, state: TextState) -> dict[str, str]:
        return {"text": state.text()}


def _held(value: Any) -> str:
    """A prompt that is neither text nor token ids, as a refusal names it:
    by what it holds, never by its repr (a list of a million ids; an int of
    thousands of digits, whose repr raises past 4,300)."""
    if not isinstance(value, (list, tuple)):
        return type(value).__name__
    kind = type(value).__name__
    if not value:
        return f"an empty {kind}"
    at, item = next((i, t) for i, t in enumerate(value) if not isinstance(t, int) or isinstance(t, bool))
    return f"a {kind} holding a {type(item).__name__} at [{at}]"
