"""Spatial codec: abstract values (x, y, size) to tokens and back.

Coordinates are normalized to [0, 1] with the origin at the top left; a size
is a width or a height in the same units. Skills speak only of kinds
(``Kind.X``, ``Kind.Y``, ``Kind.SIZE``); the codec says which token ids carry
a value of a kind and what value a committed token stands for. Two codecs:

- ``LocationCodec`` (the default): tokens added to any tokenizer,
  ``<loc_0>``…``<loc_{n-1}>`` for coordinate bins (x and y share them) and
  ``<size_0>``…``<size_{m-1}>`` for log-spaced size bins. The value is the
  bin's, so it works with any model that learned the tokens.
- ``RegionHeadCodec`` (moondream2): the value is decoded by the model's
  region head from the step's hidden state, beside whatever token the step
  samples; no token is reserved for values. A state asks for it with
  ``value_kind()`` (``core.values.ValueKind``); the backend delivers it as
  ``value`` in ``DecodeState.advance``: a float for a coordinate, a
  (width, height) pair for a size, so a box's size is one step.

Skills do not branch on the codec: they ask it for the kinds of an object's
slots (``size_slots``) and for each slot's value kind.
"""

from __future__ import annotations

import enum
import math
from typing import Protocol, runtime_checkable

import attrs

from bubblefree.core.values import ValueKind
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

    def value_kind(self, kind: Kind) -> ValueKind | None:
        """The value the backend decodes beside a token of ``kind`` (a region
        head), or None when the token itself carries it."""
        ...

    def decode(self, kind: Kind, token: int, value):
        """The value a committed token of ``kind`` stands for: a float, or a
        (width, height) pair for a region head's size."""
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

    def value_kind(self, kind: Kind) -> None:
        return None  # the token is the value

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
    """moondream2's region head: values decoded from the hidden state.

    moondream's reference decides "another object, or the end" by whether the
    argmax over the whole vocabulary is EOS, and decodes x from that same
    step's hidden state; y and the size are then decoded from the next
    steps' hidden states, whose tokens it never reads. So any token but EOS
    carries a value here, and the token itself means nothing: ``ids`` is
    every token but EOS (a y or size step cannot end the request), and the
    value is what ``advance`` receives. A size is one (width, height) step.
    """

    vocab_size: int
    eos_id: int
    _ids: frozenset[int] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.eos_id < self.vocab_size:
            raise CodecError(f"eos_id {self.eos_id} is not in a vocabulary of {self.vocab_size}")
        object.__setattr__(self, "_ids", frozenset(range(self.vocab_size)) - {self.eos_id})

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> RegionHeadCodec:
        return cls(vocab_size=len(tokenizer), eos_id=tokenizer.eos_id)

    def ids(self, kind: Kind) -> frozenset[int]:
        return self._ids

    def spatial_ids(self) -> frozenset[int]:
        return frozenset()  # no token is reserved: free text keeps them all

    def value_kind(self, kind: Kind) -> ValueKind:
        return ValueKind.SIZE if kind is Kind.SIZE else ValueKind.COORD

    def decode(self, kind: Kind, token: int, value):
        # The token is not read (see the class docstring); the value must be
        # there: a missing one means a backend without a region head was
        # paired with this codec.
        if kind is Kind.SIZE:
            if not (isinstance(value, tuple) and len(value) == 2 and all(map(_finite, value))):
                raise CodecError(f"size step (token {token}) committed without a (width, height) value, "
                                 f"got {value!r}")
            return (_clamp01(value[0]), _clamp01(value[1]))
        if not _finite(value):
            raise CodecError(f"{kind.value} step (token {token}) committed without a decoded value, "
                             f"got {value!r}")
        return _clamp01(value)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def size_slots(codec: SpatialCodec) -> tuple[Kind, ...]:
    """A size's slots: one step when the codec's size value is a (width,
    height) pair (a region head), width then height otherwise."""
    return (Kind.SIZE,) if codec.value_kind(Kind.SIZE) is ValueKind.SIZE else (Kind.SIZE, Kind.SIZE)


def box_from_centre(cx: float, cy: float, w: float, h: float) -> dict[str, float]:
    """A box as the user sees it: centre ± size/2, clamped to the image."""
    return {"x_min": _clamp01(cx - w / 2), "y_min": _clamp01(cy - h / 2),
            "x_max": _clamp01(cx + w / 2), "y_max": _clamp01(cy + h / 2)}

