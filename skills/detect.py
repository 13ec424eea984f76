"""``detect(object)`` → ``{"objects": [{"x_min", "y_min", "x_max", "y_max"}, …]}``.

The x, y, size cycle: the box centre's x (or EOS), its y, then its size as
two size tokens, width then height (one scalar per token, so a region head
delivers each as one ``value``). A box is centre ± size/2, clamped to [0, 1].
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs

from bubblefree.skills.base import CompileContext, Skill
from bubblefree.skills.codec import Kind, box_from_centre
from bubblefree.skills.objects import ObjectListState, ObjectTables, compile_objects
from bubblefree.skills.point import ObjectArgs, parse_object_args
from bubblefree.skills.tokenizer import Tokenizer

BOX_SLOTS = (Kind.X, Kind.Y, Kind.SIZE, Kind.SIZE)


@attrs.frozen
class Detect(Skill):
    name: str = "detect"
    spatial: ClassVar[bool] = True

    def parse_args(self, args: Mapping[str, Any]) -> ObjectArgs:
        return parse_object_args(self.name, args)

    def prompt(self, tokenizer: Tokenizer, args: ObjectArgs) -> list[int]:
        return tokenizer.prompt(f"\n\nDetect: {args.object}\n\n", f"Detect: {args.object}")

    def default_max_tokens(self, args: ObjectArgs) -> int:
        return len(BOX_SLOTS) * args.max_objects + 1

    def compile(self, ctx: CompileContext) -> ObjectTables:
        return compile_objects(ctx, BOX_SLOTS)

    def start(self, tables: ObjectTables, args: ObjectArgs, budget: int) -> ObjectListState:
        return ObjectListState(tables, max_objects=args.max_objects, budget=budget)

    def finish(self, state: ObjectListState) -> dict[str, list[dict[str, float]]]:
        return {"objects": [box_from_centre(*box) for box in state.objects]}
