"""The object-list machine behind ``point`` and ``detect``.

An output is a list of objects, each a fixed cycle of spatial slots (point:
x, y; detect: x, y, then the size: one slot on a region head, whose size is
a (width, height) pair, two with location tokens). The state is the slot
index; the table maps it to a mask id:

    slot 0      a value of slot 0's kind, or EOS (the list ends)
    slot i > 0  a value of slot i's kind only (an object, once begun, ends)

On a region head slot 0 is unconstrained (mask None): as in moondream's
reference, the model's own choice over the whole vocabulary says "another
object" (any token but EOS, whose step's value is x) or "the end" (EOS).
The other slots allow any token but EOS: their tokens are not read, only
their values. ``value_kind()`` says which value each slot asks the backend
for (None with location tokens, where the token is the value).

The list also ends, without EOS, once ``max_objects`` objects are out or the
budget cannot hold another whole object; a request whose budget cannot hold
even one object may only say EOS (and asks no value).
"""

from __future__ import annotations

from typing import Any

import attrs

from bubblefree.core.values import ValueKind
from bubblefree.skills.base import CompileContext, SkillError, SkillState
from bubblefree.skills.codec import Kind, SpatialCodec


@attrs.frozen
class ObjectTables:
    slots: tuple[Kind, ...]
    slot_masks: tuple[int | None, ...]  # mask id per slot; None: any token
    slot_ids: tuple[frozenset[int] | None, ...]  # allowed ids per slot (EOS aside); None: any
    value_kinds: tuple[ValueKind | None, ...]  # what each slot asks the backend to decode
    end_mask: int  # EOS only
    eos_id: int
    codec: SpatialCodec


def compile_objects(ctx: CompileContext, slots: tuple[Kind, ...]) -> ObjectTables:
    codec = ctx.codec
    kinds = tuple(codec.value_kind(k) for k in slots)
    ids: list[frozenset[int] | None] = [codec.ids(k) for k in slots]
    masks: list[int | None] = []
    for i in range(len(slots)):
        if i == 0 and kinds[0] is not None:
            ids[0] = None  # region head: the whole vocabulary decides (see above)
            masks.append(None)
        else:
            masks.append(ctx.mask(ids[i] | {ctx.eos_id} if i == 0 else ids[i]))
    return ObjectTables(slots=slots, slot_masks=tuple(masks), slot_ids=tuple(ids),
                        value_kinds=kinds, end_mask=ctx.mask(frozenset({ctx.eos_id})),
                        eos_id=ctx.eos_id, codec=codec)


def flatten(values: list[Any]) -> tuple[float, ...]:
    """An object's slot values as one tuple: a size pair is two numbers."""
    return tuple(x for v in values for x in (v if isinstance(v, tuple) else (v,)))


@attrs.define
class ObjectListState(SkillState):
    tables: ObjectTables
    max_objects: int
    budget: int
    objects: list[tuple[float, ...]] = attrs.Factory(list)
    partial: list[Any] = attrs.Factory(list)  # slot values of the object in progress
    consumed: int = 0
    done: bool = False

    def _fits(self, used: int) -> bool:
        return self.budget - used >= len(self.tables.slots)

    def _ending(self) -> bool:
        return not self.partial and not self._fits(self.consumed)

    def mask_id(self) -> int | None:
        if self._ending():
            return self.tables.end_mask
        return self.tables.slot_masks[len(self.partial)]

    def value_kind(self) -> ValueKind | None:
        if self.done or self._ending():
            return None  # only EOS can come: nothing to decode
        return self.tables.value_kinds[len(self.partial)]

    def may_end(self) -> bool:
        """The list ends only at slot 0 (EOS), or with the object whose last
        slot this is when it is the last one allowed or the last that fits."""
        last = len(self.tables.slots) - 1
        return not self.partial or (len(self.partial) == last and (
            len(self.objects) + 1 >= self.max_objects or not self._fits(self.consumed + 1)))

    def _step(self, token: int, value: Any) -> None:
        t = self.tables
        i = len(self.partial)
        if i == 0 and token == t.eos_id:
            self.done = True
            return
        if i == 0 and not self._fits(self.consumed):
            raise SkillError(f"token {token}: no whole object fits the budget; only EOS")
        allowed = t.slot_ids[i]
        if allowed is not None and token not in allowed:
            raise SkillError(f"token {token} is not a {t.slots[i].value} value")
        v = t.codec.decode(t.slots[i], token, value)  # may raise: still unchanged
        self.partial.append(v)
        if len(self.partial) == len(t.slots):
            self.objects.append(flatten(self.partial))
            self.partial.clear()
            if len(self.objects) >= self.max_objects or not self._fits(self.consumed + 1):
                self.done = True
