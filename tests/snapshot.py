"""Fast deep copies of an Engine + FakeBackend world, for the search's branch
points.

``copy.deepcopy`` goes through pickling's ``__reduce_ex__`` machinery for
slotted ``attrs`` classes, and its per-object overhead dominated the search.
``Cloner`` is a deep copy specialised to what a world holds:

- atomic values, enum members, functions and *frozen* attrs values are
  shared: they cannot change, so a snapshot may hold the very same object;
- mutable attrs records are copied field by field, containers element by
  element, a ``random.Random`` by its state (auto's tie-breaking draws:
  ``copy.deepcopy`` went through its 625-word state element by element, a
  third of the search's time), an ``itertools.count`` (the engine's
  request ids, the clock's order) by where it stands (Python deprecated
  copying itertools objects in 3.12 and removed it in 3.14); anything
  else falls back to ``copy.deepcopy`` with the same memo, so shared
  structure stays shared exactly once.

One hazard: the fake backend schedules a copy's landing as a closure over
its slot, and a deep copy shares functions. A closure is therefore rebuilt
over the twin's own objects, or the twin's copy would land in the original's
host buffer. Another: the scheduler's register of held decode states is
keyed by the states' ids, which a copy changes; it is re-keyed by the
twins' (``_rekey_held``).
"""

from __future__ import annotations

import collections
import copy
import enum
import itertools
import random
import types
from typing import Any, Callable, Iterable

import attrs

from bubblefree.core import Scheduler

_ATOMIC = (int, float, str, bool, bytes, type(None), types.BuiltinFunctionType)


def _is_frozen(cls: type) -> bool:
    return getattr(cls.__setattr__, "__name__", "") == "_frozen_setattrs"


class Cloner:
    """``Cloner().copy(world, shared)``: a deep copy sharing ``shared`` and
    every immutable value."""

    def __init__(self) -> None:
        self._how: dict[type, Callable[[Any, dict], Any]] = {}
        self._fields: dict[type, tuple[str, ...]] = {}

    def copy(self, x: Any, shared: Iterable[object] = ()) -> Any:
        return self._clone(x, {id(o): o for o in shared})

    def _clone(self, x: Any, memo: dict) -> Any:
        how = self._how.get(type(x)) or self._learn(type(x))
        if how is _share:
            return x
        twin = memo.get(id(x), _MISSING)
        if twin is _MISSING:
            twin = how(x, memo)
        return twin

    def _items(self, xs: Iterable[Any], memo: dict) -> list[Any]:
        """``[_clone(e) for e in xs]``, inlined: most items are plain ints."""
        hows, out = self._how, []
        for e in xs:
            how = hows.get(type(e)) or self._learn(type(e))
            if how is not _share:
                twin = memo.get(id(e), _MISSING)
                e = how(e, memo) if twin is _MISSING else twin
            out.append(e)
        return out

    def _learn(self, t: type) -> Callable[[Any, dict], Any]:
        if issubclass(t, _ATOMIC) or issubclass(t, enum.Enum) or (attrs.has(t) and _is_frozen(t)):
            how = _share
        elif attrs.has(t):
            how = self._record
        else:
            how = {tuple: self._tuple, list: self._list, dict: self._dict, set: self._set,
                   frozenset: self._frozenset, collections.deque: self._deque,
                   types.FunctionType: self._function, types.MethodType: self._method,
                   random.Random: _random, itertools.count: _count}.get(t, _fallback)
        self._how[t] = how
        return how

    def _record(self, x, memo):
        cls = type(x)
        names = self._fields.get(cls)
        if names is None:
            names = self._fields[cls] = tuple(f.name for f in cls.__attrs_attrs__)
        twin = object.__new__(cls)
        memo[id(x)] = twin
        for name, value in zip(names, self._items([getattr(x, n) for n in names], memo)):
            object.__setattr__(twin, name, value)
        if cls is Scheduler:
            _rekey_held(x, twin, memo)
        return twin

    def _tuple(self, x, memo):  # page ids, KV addresses
        return self._immutable(x, memo, tuple)

    def _frozenset(self, x, memo):  # masks, stop ids
        return self._immutable(x, memo, frozenset)

    def _immutable(self, x, memo, make):
        """An immutable container is shared unless something inside it must be copied."""
        hows = self._how
        if all(hows.get(type(e)) is _share for e in x):
            return x
        items = self._items(x, memo)
        twin = x if all(a is b for a, b in zip(items, x)) else make(items)
        memo[id(x)] = twin
        return twin

    def _list(self, x, memo):
        hows = self._how
        if all(hows.get(type(e)) is _share for e in x):  # tokens, free ids
            twin = memo[id(x)] = list(x)
            return twin
        twin = []
        memo[id(x)] = twin
        twin.extend(self._items(x, memo))
        return twin

    def _deque(self, x, memo):
        twin = collections.deque(maxlen=x.maxlen)
        memo[id(x)] = twin
        twin.extend(self._items(x, memo))
        return twin

    def _set(self, x, memo):
        hows = self._how
        if all(hows.get(type(e)) is _share for e in x):
            twin = memo[id(x)] = set(x)
            return twin
        twin = set()
        memo[id(x)] = twin
        twin.update(self._items(x, memo))
        return twin

    def _dict(self, x, memo):
        hows = self._how
        if all(hows.get(type(v)) is _share for v in x.values()) and all(
                hows.get(type(k)) is _share or (type(k) is tuple and all(hows.get(type(i)) is _share for i in k))
                for k in x):  # the KV cache: (page, offset) -> a frozen entry
            twin = memo[id(x)] = dict(x)
            return twin
        twin = {}
        memo[id(x)] = twin
        twin.update(zip(self._items(x.keys(), memo), self._items(x.values(), memo)))
        return twin

    def _method(self, x, memo):
        return types.MethodType(x.__func__, self._clone(x.__self__, memo))

    def _function(self, x, memo):
        if not x.__closure__:
            return x
        cells = tuple(types.CellType(self._clone(c.cell_contents, memo)) for c in x.__closure__)
        twin = types.FunctionType(x.__code__, x.__globals__, x.__name__, x.__defaults__, cells)
        memo[id(x)] = twin
        return twin


_MISSING = object()


def _rekey_held(x: Scheduler, twin: Scheduler, memo: dict) -> None:
    """``held`` maps ``id(state)`` to its holder: each key becomes the id of
    that state's twin. A key naming no state of its holder stays as it is,
    for the twin's integrity check to find as the original's would."""
    def key(old: int, seq_id: int) -> int:
        seq = x.seqs.get(seq_id)
        state = None if seq is None else seq.state
        return id(memo[id(state)]) if state is not None and id(state) == old and id(state) in memo else old
    twin.held = {key(k, v): v for k, v in x.held.items()}


def _share(x, memo):
    return x


def _random(x: random.Random, memo: dict) -> random.Random:
    twin = memo[id(x)] = random.Random(0)
    twin.setstate(x.getstate())  # an immutable tuple: no element is copied
    return twin


def _count(x: itertools.count, memo: dict) -> itertools.count:
    """Its next value and step read from its repr, ``count(5)`` or
    ``count(5, 2)``: the one way to see them without drawing."""
    start, _, step = repr(x)[len("count("):-1].partition(", ")
    twin = memo[id(x)] = itertools.count(int(start), int(step) if step else 1)
    return twin


def _fallback(x, memo):
    return copy.deepcopy(x, memo)
