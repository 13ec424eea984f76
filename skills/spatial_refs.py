"""moondream's spatial references: points and boxes a question refers to.

``query(image, question, spatial_refs=[[x, y], [x_min, y_min, x_max, y_max]])``
(normalized to the image, as moondream's client sends them) puts
placeholder tokens after the query template's prefix: a point is two
``coord_id`` positions (x, y), a box its centre's two ``coord_id`` positions
then one ``size_id`` position (width, height). The forward reads the
region encoder's output of each value there instead of the placeholder's
embedding (``core.values.PromptValue``), as moondream's reference does.
Only a checkpoint whose tokenizer config names both placeholders takes them.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

from bubblefree.core.values import PromptValue, ValueKind, shown
from bubblefree.skills.base import invalid

Ref = tuple[float, ...]


def spatial_refs_arg(skill: str, args: Mapping[str, Any]) -> tuple[Ref, ...]:
    """The ``spatial_refs`` argument as tuples of floats, or (); every
    problem named with the reference's index."""
    value = args.get("spatial_refs")
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise invalid(skill, "spatial_refs", f"must be a list of [x, y] points or [x_min, y_min, x_max, "
                      f"y_max] boxes, got {type(value).__name__}")
    return tuple(_ref(skill, i, ref) for i, ref in enumerate(value))


def _ref(skill: str, i: int, ref: Any) -> Ref:
    field = f"spatial_refs[{i}]"
    if isinstance(ref, (str, bytes)) or not isinstance(ref, (list, tuple)) or len(ref) not in (2, 4):
        raise invalid(skill, field, f"must be [x, y] or [x_min, y_min, x_max, y_max], got {shown(ref)}")
    for v in ref:
        # bool is an int, but never a coordinate; NaN fails both comparisons.
        # Any real number: numpy's and Fractions too, as sampling takes them.
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 <= v <= 1.0:
            raise invalid(skill, field, f"coordinates must be numbers in [0, 1], got {shown(v)}")
    out = tuple(float(v) for v in ref)
    if len(out) == 4 and not (out[0] < out[2] and out[1] < out[3]):
        raise invalid(skill, field, f"a box needs x_min < x_max and y_min < y_max, got {list(out)}")
    return out


def place(refs: tuple[Ref, ...], at: int, coord_id: int, size_id: int) -> tuple[list[int], tuple[PromptValue, ...]]:
    """The placeholder ids for ``refs`` and their values, the first at
    prompt index ``at``."""
    ids: list[int] = []
    values: list[PromptValue] = []

    def put(token: int, kind: ValueKind, value: Any) -> None:
        values.append(PromptValue(at + len(ids), kind, value))
        ids.append(token)

    for ref in refs:
        if len(ref) == 2:
            put(coord_id, ValueKind.COORD, ref[0])
            put(coord_id, ValueKind.COORD, ref[1])
        else:
            x0, y0, x1, y1 = ref
            put(coord_id, ValueKind.COORD, (x0 + x1) / 2)
            put(coord_id, ValueKind.COORD, (y0 + y1) / 2)
            put(size_id, ValueKind.SIZE, (x1 - x0, y1 - y0))
    return ids, tuple(values)
