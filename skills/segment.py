"""``segment(object)`` → ``{"path": svg_path_d, "bbox": {...}}``.

Served by models with location tokens (text models, with an image where the
backend takes one). moondream2 (a region head) has no segment skill in its
reference implementation, so it refuses segment requests (``unserved``).

First a bbox, as one ``detect`` box (x or EOS, y, width, height; EOS there
means "not found": ``{"path": "", "bbox": None}``). Then an SVG path under
``path_grammar``: commands as text, numbers as coordinate tokens read
*relative to the bbox* (0..1 in bbox units). The result's path is in
absolute normalized image coordinates (0–1, origin top left), like the bbox,
so it can be drawn over the image directly; since every relative number lies
in [0, 1], the outline stays inside its bbox. Numbers are written with six
decimals at most and clamped to the bbox after rounding, so the guarantee
survives formatting. A command cut short by the budget is dropped.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs

from bubblefree.skills.base import (CompileContext, Skill, SkillError, SkillState, check_fields,
                         text_arg)
from bubblefree.skills.codec import Kind, SpatialCodec, box_from_centre
from bubblefree.skills.detect import BOX_SLOTS
from bubblefree.skills.objects import ObjectTables, compile_objects
from bubblefree.skills.path_grammar import Command, PathTables, compile_path, whole_commands
from bubblefree.skills.tokenizer import Tokenizer

# The least worth starting: a bbox, then "M x y" after the lone space the
# path grammar allows before it (without that space counted, a budget of
# bbox + 3 could end at "M x", an outline of nothing).
MIN_TOKENS = len(BOX_SLOTS) + 4


@attrs.frozen
class SegmentTables:
    bbox: ObjectTables
    path: PathTables
    codec: SpatialCodec


@attrs.define
class SegmentState(SkillState):
    tables: SegmentTables
    budget: int
    partial: list[float] = attrs.Factory(list)  # bbox values so far
    bbox: tuple[float, ...] | None = None  # (cx, cy, w, h) once whole
    path_state: int = 0
    path_items: list[tuple[int, float | None]] = attrs.Factory(list)
    consumed: int = 0
    done: bool = False

    def mask_id(self) -> int | None:
        if self.bbox is not None:
            return self.tables.path.masks[self.path_state]
        box = self.tables.bbox
        if not self.partial and self.budget - self.consumed < MIN_TOKENS:
            return box.end_mask
        return box.slot_masks[len(self.partial)]

    def _step(self, token: int, value: float | None) -> None:
        if self.bbox is None:
            self._step_bbox(token, value)
            return
        path = self.tables.path
        if token == self.tables.bbox.eos_id:
            if self.path_state not in path.dfa.accepting:
                raise SkillError(f"EOS in the middle of a path command (state "
                                 f"{path.dfa.names[self.path_state]})")
            self.done = True
            return
        nxt = path.trans[self.path_state].get(token)
        if nxt is None:
            raise SkillError(f"token {token} breaks the path grammar in state "
                             f"{path.dfa.names[self.path_state]}")
        if token in path.num_ids:
            # Decoded now only to fail before any change if the value is bad.
            self.tables.codec.decode(Kind.X, token, value)
        self.path_items.append((token, value))
        self.path_state = nxt

    def _step_bbox(self, token: int, value: float | None) -> None:
        box = self.tables.bbox
        i = len(self.partial)
        if i == 0 and token == box.eos_id:
            self.done = True
            return
        if i == 0 and self.budget - self.consumed < MIN_TOKENS:
            raise SkillError(f"token {token}: no outline fits the budget; only EOS")
        if token not in box.slot_ids[i]:
            raise SkillError(f"token {token} is not a bbox {box.slots[i].value} value")
        self.partial.append(box.codec.decode(box.slots[i], token, value))
        if len(self.partial) == len(box.slots):
            self.bbox = tuple(self.partial)
            self.path_state = self.tables.path.dfa.start


def _fmt(v: float) -> str:
    return f"{v:.6f}".rstrip("0").rstrip(".")


def render_path(commands: list[Command], bbox: Mapping[str, float]) -> str:
    """Absolute normalized SVG path ``d``; every point inside ``bbox``."""
    lo = (bbox["x_min"], bbox["y_min"])
    hi = (bbox["x_max"], bbox["y_max"])
    parts = []
    for cmd in commands:
        parts.append(cmd.letter)
        for i, r in enumerate(cmd.args):
            a = i % 2  # 0: x, 1: y
            v = round(lo[a] + r * (hi[a] - lo[a]), 6)
            parts.append(_fmt(min(hi[a], max(lo[a], v))))
    return " ".join(parts)


@attrs.frozen
class SegmentArgs:
    object: str


@attrs.frozen
class Segment(Skill):
    name: str = "segment"
    spatial: ClassVar[bool] = True
    max_tokens: int = 512

    def unserved(self, codec: SpatialCodec | None) -> str | None:
        if codec is not None and codec.value_kind(Kind.X) is not None:
            # moondream2's reference answers caption, query, point and detect;
            # a path of region-head values would be a format it never learned.
            return ("a model with a region head (moondream2) has no segment skill: its "
                    "reference answers caption, query, point and detect; segment needs a model "
                    "with location tokens")
        return super().unserved(codec)

    def parse_args(self, args: Mapping[str, Any]) -> SegmentArgs:
        check_fields(self.name, args, ("object",))
        return SegmentArgs(object=text_arg(self.name, args, "object"))

    def prompt(self, tokenizer: Tokenizer, args: SegmentArgs) -> list[int]:
        return tokenizer.prompt(f"\n\nSegment: {args.object}\n\n", f"Segment: {args.object}")

    def default_max_tokens(self, args: SegmentArgs) -> int:
        return self.max_tokens

    def compile(self, ctx: CompileContext) -> SegmentTables:
        return SegmentTables(bbox=compile_objects(ctx, BOX_SLOTS),
                             path=compile_path(ctx, ctx.codec.ids(Kind.X) | ctx.codec.ids(Kind.Y)),
                             codec=ctx.codec)

    def start(self, tables: SegmentTables, args: SegmentArgs, budget: int) -> SegmentState:
        return SegmentState(tables, budget=budget)

    def finish(self, state: SegmentState) -> dict[str, Any]:
        if state.bbox is None:
            return {"path": "", "bbox": None}
        # Rounded first: the path is clamped to the bbox exactly as printed.
        bbox = {k: round(v, 6) for k, v in box_from_centre(*state.bbox).items()}
        commands = whole_commands(state.tables.path, state.tables.codec, state.path_items)
        return {"path": render_path(commands, bbox), "bbox": bbox}
