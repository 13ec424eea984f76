"""``yesno(question)`` → ``{"answer": bool | None}``: the worked example of
docs/skills.md. One constrained token: any token that reads "yes" or "no".

``None`` is the answer only when no token was committed (a cancel).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from bubblefree.skills.base import CompileContext, Skill, SkillError, SkillState, check_fields, text_arg
from bubblefree.skills.templates import templates_of
from bubblefree.skills.tokenizer import Tokenizer


@attrs.frozen
class YesNoTables:
    mask: int  # compiled once: the ids of every spelling of yes and no
    yes_ids: frozenset[int]
    no_ids: frozenset[int]


@attrs.define
class YesNoState(SkillState):
    tables: YesNoTables
    answer: bool | None = None
    consumed: int = 0
    done: bool = False

    def mask_id(self) -> int | None:
        return self.tables.mask

    def _step(self, token: int, value: float | None) -> None:
        if token in self.tables.yes_ids:
            self.answer = True
        elif token in self.tables.no_ids:
            self.answer = False
        else:
            raise SkillError(f"token {token} is neither yes nor no")
        self.done = True


@attrs.frozen
class YesNoArgs:
    question: str


@attrs.frozen
class YesNo(Skill):
    name: str = "yesno"

    def parse_args(self, args: Mapping[str, Any]) -> YesNoArgs:
        check_fields(self.name, args, ("question",))
        return YesNoArgs(question=text_arg(self.name, args, "question"))

    def prompt(self, tokenizer: Tokenizer, args: YesNoArgs) -> list[int]:
        templates = templates_of(tokenizer)
        if templates is not None:
            return templates.query_prompt(tokenizer, f"{args.question} Answer yes or no.")
        return tokenizer.prompt(f"\n\nQuestion: {args.question} Answer yes or no.\n\nAnswer:",
                                f"{args.question} Answer yes or no.")

    def default_max_tokens(self, args: YesNoArgs) -> int:
        return 1

    def compile(self, ctx: CompileContext) -> YesNoTables:
        # Walks the vocabulary once, here, never per step.
        words = [s.strip().lower() for s in ctx.tokenizer.vocab]
        yes = frozenset(i for i, w in enumerate(words) if w == "yes")
        no = frozenset(i for i, w in enumerate(words) if w == "no")
        if not yes or not no:
            raise SkillError("yesno needs tokens spelling 'yes' and 'no' in the tokenizer")
        return YesNoTables(mask=ctx.mask(yes | no), yes_ids=yes, no_ids=no)

    def start(self, tables: YesNoTables, args: YesNoArgs, budget: int) -> YesNoState:
        return YesNoState(tables)

    def finish(self, state: YesNoState) -> dict[str, bool | None]:
        return {"answer": state.answer}
