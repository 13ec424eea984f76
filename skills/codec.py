"""Spatial codec: abstract values (x, y, size) to tokens and back.

Coordinates are normalized to [0, 1] with the origin at the top left; a size
is a width or a height in the same units. Skills speak only of kinds
(``Kind.X``, ``Kind.Y``, ``Kind.SIZE``); the codec says which token ids carry
a value of a kind and what value a committed token stands for. Two codecs:

- ``LocationCodec`` (the default): tokens added to any tokenizer,
  ``<loc_0>``…``<loc_{n-1}>`` for coordinate bins (x and y share them) and
  ``<size_0>``…``<size_{m-1}>`` for log-spaced size bins. The value is the
  bin's, so it works with any model that learned the tokens.
- ``RegionHeadCodec``: one coordinate token and one size token whose value a
  small head decodes from the hidden state; the backend delivers it as
  ``value`` in ``DecodeState.advance``. Skills do not change.
"""

from __future__ import annotations

import enum
import math
from typing import Protocol, runtime_checkable

import attrs

from bubblefree.skills.tokenizer import Tokenizer


class Kind(enum.Enum):
    X = "x"
    Y = "y"
    SIZE = "size"


class CodecError(ValueError):
    """A token or value the codec cannot interpret."""


@runtime_checkable
class SpatialCodec(Protocol):
    def ids(self, kind: Kind) -> frozenset[int]:
        """Token ids that carry a value of ``kind``."""
        ...

    def spatial_ids(self) -> frozenset[int]:
        """Every spatial token: free text never samples these."""
        ...

    def decode(self, kind: Kind, token: int, value: float | None) -> float:
        """The value a committed token of ``kind`` stands for."""
        ...

    def encode(self, kind: Kind, value: float) -> int:
        """The token that carries ``value`` (a region head carries the value
        itself beside its one token)."""
        ...


def location_tokens(coord_bins: int = 1024, size_bins: int = 64) -> tuple[str, ...]:
    """The token strings ``LocationCodec`` needs, to add to a tokenizer."""
    return (tuple(f"<loc_{k}>" for k in range(coord_bins))
            + tuple(f"<size_{k}>" for k in range(size_bins)))


def _clamp01(v: float) -> float:
    return 0.0 if v < 0.0 else 1.0 if v > 1.0 else v


@attrs.frozen
class LocationCodec:
    """Coordinates in ``len(coord_ids)`` equal bins, decoded to bin centres;
    sizes in ``len(size_ids)`` bins spaced evenly in log from ``min_size``
    to 1, decoded to the bin's size."""

    coord_ids: tuple[int, ...] = attrs.field(converter=tuple)
    size_ids: tuple[int, ...] = attrs.field(converter=tuple)
    min_size: float = 1.0 / 1024
    _bin: dict[int, int] = attrs.field(init=False, eq=False, repr=False)
    _coords: frozenset[int] = attrs.field(init=False, eq=False, repr=False)
    _sizes: frozenset[int] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if len(self.coord_ids) < 2 or len(self.size_ids) < 2:
            raise CodecError("a LocationCodec needs at least 2 coordinate and 2 size bins")
        if not (0.0 < self.min_size < 1.0):
            raise CodecError(f"min_size must be in (0, 1), got {self.min_size!r}")
        coords, sizes = frozenset(self.coord_ids), frozenset(self.size_ids)
        if len(coords) != len(self.coord_ids) or len(sizes) != len(self.size_ids) or coords & sizes:
            raise CodecError("location token ids must be distinct")
        bins = {t: k for k, t in enumerate(self.coord_ids)}
        bins.update({t: k for k, t in enumerate(self.size_ids)})
        object.__setattr__(self, "_bin", bins)
        object.__setattr__(self, "_coords", coords)
        object.__setattr__(self, "_sizes", sizes)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, *, coord_bins: int = 1024,
                      size_bins: int = 64, min_size: float = 1.0 / 1024) -> LocationCodec:
        wanted = location_tokens(coord_bins, size_bins)
        wanted_set = set(wanted)
        index = {s: i for i, s in enumerate(tokenizer.vocab) if s in wanted_set}
        missing = [s for s in wanted if s not in index]
        if missing:
            raise CodecError(f"the tokenizer lacks {len(missing)} location tokens (first: "
                             f"{missing[0]!r}); add codec.location_tokens() to it")
        ids = [index[s] for s in wanted]
        return cls(coord_ids=ids[:coord_bins], size_ids=ids[coord_bins:], min_size=min_size)

    def ids(self, kind: Kind) -> frozenset[int]:
        return self._sizes if kind is Kind.SIZE else self._coords

    def spatial_ids(self) -> frozenset[int]:
        return self._coords | self._sizes

    def decode(self, kind: Kind, token: int, value: float | None = None) -> float:
        if token not in self.ids(kind):
            raise CodecError(f"token {token} carries no {kind.value} value")
        k = self._bin[token]
        if kind is Kind.SIZE:
            return self.min_size ** (1.0 - k / (len(self.size_ids) - 1))
        return (k + 0.5) / len(self.coord_ids)

    def encode(self, kind: Kind, value: float) -> int:
        if not math.isfinite(value):
            raise CodecError(f"cannot encode {value!r}")
        if kind is Kind.SIZE:
            n = len(self.size_ids)
            s = min(1.0, max(self.min_size, value))
            k = round((1.0 - math.log(s) / math.log(self.min_size)) * (n - 1))
            return self.size_ids[min(n - 1, max(0, k))]
        n = len(self.coord_ids)
        return self.coord_ids[min(n - 1, max(0, math.floor(value * n)))]


@attrs.frozen
class RegionHeadCodec:
    """One coordinate token and one size token; the value comes from the
    model's region head, clamped to [0, 1]."""

    coord_id: int
    size_id: int

    def ids(self, kind: Kind) -> frozenset[int]:
        return frozenset({self.size_id if kind is Kind.SIZE else self.coord_id})

    def spatial_ids(self) -> frozenset[int]:
        return frozenset({self.coord_id, self.size_id})

    def decode(self, kind: Kind, token: int, value: float | None) -> float:
        if token not in self.ids(kind):
            raise CodecError(f"token {token} carries no {kind.value} value")
        if value is None or not math.isfinite(value):
            # The backend must deliver the head's value with the token; a
            # missing one means a model without a region head was paired
            # with this codec.
            raise CodecError(f"region token {token} committed without a decoded value")
        return _clamp01(value)

    def encode(self, kind: Kind, value: float) -> int:
        return self.size_id if kind is Kind.SIZE else self.coord_id


def box_from_centre(cx: float, cy: float, w: float, h: float) -> dict[str, float]:
    """A box as the user sees it: centre ± size/2, clamped to the image."""
    return {"x_min": _clamp01(cx - w / 2), "y_min": _clamp01(cy - h / 2),
            "x_max": _clamp01(cx + w / 2), "y_max": _clamp01(cy + h / 2)}

