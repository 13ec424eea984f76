"""The object-list machine behind ``point`` and ``detect``.

An output is a list of objects, each a fixed cycle of spatial slots (point:
x, y; detect: x, y, width, height). The state is the slot index; the table
maps it to a mask id:

    slot 0      a value of slot 0's kind, or EOS (the list ends)
    slot i > 0  a value of slot i's kind only (an object, once begun, ends)

The list also ends, without EOS, once ``max_objects`` objects are out or the
budget cannot hold another whole object; a request whose budget cannot hold
even one object may only say EOS.
"""

from __future__ import annotations

import attrs

from bubblefree.skills.base import CompileContext, SkillError, SkillState
from bubblefree.skills.codec import Kind, SpatialCodec


@attrs.frozen
class ObjectTables:
    slots: tuple[Kind, ...]
    slot_masks: tuple[int, ...]  # mask id per slot
    slot_ids: tuple[frozenset[int], ...]  # allowed ids per slot (EOS aside)
    end_mask: int  # EOS only
    eos_id: int
    codec: SpatialCodec


def compile_objects(ctx: CompileContext, slots: tuple[Kind, ...]) -> ObjectTables:
    ids = tuple(ctx.codec.ids(k) for k in slots)
    masks = tuple(ctx.mask(ids[i] | {ctx.eos_id} if i == 0 else ids[i])
                  for i in range(len(slots)))
    return ObjectTables(slots=slots, slot_masks=masks, slot_ids=ids,
                        end_mask=ctx.mask(frozenset({ctx.eos_id})),
                        eos_id=ctx.eos_id, codec=ctx.codec)


@attrs.define
class ObjectListState(SkillState):
    tables: ObjectTables
    max_objects: int
    budget: int
    objects: list[tuple[float, ...]] = attrs.Factory(list)
    partial: list[float] = attrs.Factory(list)  # values of the object in progress
    consumed: int = 0
    done: bool = False

    def _fits(self, used: int) -> bool:
        return self.budget - used >= len(self.tables.slots)

    def mask_id(self) -> int | None:
        if not self.partial and not self._fits(self.consumed):
            return self.tables.end_mask
        return self.tables.slot_masks[len(self.partial)]

    def may_end(self) -> bool:
        """The list ends only at slot 0 (EOS), or with the object whose last
        slot this is when it is the last one allowed or the last that fits."""
        last = len(self.tables.slots) - 1
        return not self.partial or (len(self.partial) == last and (
            len(self.objects) + 1 >= self.max_objects or not self._fits(self.consumed + 1)))

    def _step(self, token: int, value: float | None) -> None:
        t = self.tables
        i = len(self.partial)
        if i == 0 and token == t.eos_id:
            self.done = True
            return
        if i == 0 and not self._fits(self.consumed):
            raise SkillError(f"token {token}: no whole object fits the budget; only EOS")
        if token not in t.slot_ids[i]:
            raise SkillError(f"token {token} is not a {t.slots[i].value} value")
        v = t.codec.decode(t.slots[i], token, value)  # may raise: still unchanged
        self.partial.append(v)
        if len(self.partial) == len(t.slots):
            self.objects.append(tuple(self.partial))
            self.partial.clear()
            if len(self.objects) >= self.max_objects or not self._fits(self.consumed + 1):
                self.done = True
