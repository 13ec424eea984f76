"""``point(object)`` → ``{"points": [{"x", "y"}, …]}``: x (or EOS), y, repeat."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs

from bubblefree.skills.base import CompileContext, Skill, check_fields, positive_int, text_arg
from bubblefree.skills.codec import Kind
from bubblefree.skills.objects import ObjectListState, ObjectTables, compile_objects
from bubblefree.skills.templates import templates_of
from bubblefree.skills.tokenizer import Tokenizer


@attrs.frozen
class ObjectArgs:
    object: str
    max_objects: int


def parse_object_args(skill: str, args: Mapping[str, Any]) -> ObjectArgs:
    check_fields(skill, args, ("object", "max_objects"))
    return ObjectArgs(object=text_arg(skill, args, "object"),
                      max_objects=positive_int(skill, args, "max_objects", 50))


@attrs.frozen
class Point(Skill):
    name: str = "point"
    spatial: ClassVar[bool] = True

    def parse_args(self, args: Mapping[str, Any]) -> ObjectArgs:
        return parse_object_args(self.name, args)

    def prompt(self, tokenizer: Tokenizer, args: ObjectArgs) -> list[int]:
        templates = templates_of(tokenizer)
        if templates is not None:
            return templates.object_prompt(tokenizer, self.name, args.object)
        return tokenizer.prompt(f"\n\nPoint: {args.object}\n\n", f"Point at: {args.object}")

    def default_max_tokens(self, args: ObjectArgs) -> int:
        return 2 * args.max_objects + 1  # two tokens a point, then EOS

    def compile(self, ctx: CompileContext) -> ObjectTables:
        return compile_objects(ctx, (Kind.X, Kind.Y))

    def start(self, tables: ObjectTables, args: ObjectArgs, budget: int) -> ObjectListState:
        return ObjectListState(tables, max_objects=args.max_objects, budget=budget)

    def finish(self, state: ObjectListState) -> dict[str, list[dict[str, float]]]:
        # state.partial (a point cut short) is dropped: whole objects only.
        return {"points": [{"x": x, "y": y} for x, y in state.objects]}
