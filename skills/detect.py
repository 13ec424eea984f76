"""``detect(object)`` → ``{"objects": [{"x_min", "y_min", "x_max", "y_max"}, …]}``.

The x, y, size cycle: the box centre's x (or EOS), its y, then its size: on
a region head one step whose value is the (width, height) pair, as
moondream2 decodes it; with location tokens two size tokens, width then
height. A box is centre ± size/2, clamped to [0, 1].
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs

from bubblefree.skills.base import CompileContext, Skill
from bubblefree.skills.codec import Kind, box_from_centre, size_slots
from bubblefree.skills.objects import ObjectListState, ObjectTables, compile_objects
from bubblefree.skills.point import ObjectArgs, parse_object_args
from bubblefree.skills.templates import templates_of
from bubblefree.skills.tokenizer import Tokenizer

BOX_SLOTS = (Kind.X, Kind.Y, Kind.SIZE, Kind.SIZE)  # with location tokens; the most a box takes


@attrs.frozen
class Detect(Skill):
    name: str = "detect"
    spatial: ClassVar[bool] = True

    def parse_args(self, args: Mapping[str, Any]) -> ObjectArgs:
        return parse_object_args(self.name, args)

    def prompt(self, tokenizer: Tokenizer, args: ObjectArgs) -> list[int]:
        templates = templates_of(tokenizer)
        if templates is not None:
            return templates.object_prompt(tokenizer, self.name, args.object)
        return tokenizer.prompt(f"\n\nDetect: {args.object}\n\n", f"Detect: {args.object}")

    def default_max_tokens(self, args: ObjectArgs) -> int:
        return len(BOX_SLOTS) * args.max_objects + 1  # the most a box takes: location tokens' 4

    def budget(self, tables: ObjectTables, args: ObjectArgs) -> int:
        return len(tables.slots) * args.max_objects + 1  # a region head's boxes take 3

    def compile(self, ctx: CompileContext) -> ObjectTables:
        return compile_objects(ctx, (Kind.X, Kind.Y) + size_slots(ctx.codec))

    def start(self, tables: ObjectTables, args: ObjectArgs, budget: int) -> ObjectListState:
        return ObjectListState(tables, max_objects=args.max_objects, budget=budget)

    def finish(self, state: ObjectListState) -> dict[str, list[dict[str, float]]]:
        return {"objects": [box_from_centre(*box) for box in state.objects]}
