"""Skills compiled for one tokenizer and one engine, and requests built on them.

``SkillSet(tokenizer, engine.register_mask)`` is the compile-once point:
each skill's tables are built the first time it is used (or all at once by
``compile_all``, which the serving ``Engine`` calls before its decode thread
starts) and cached; each distinct allowed set is registered with the engine
exactly once, however many skills or states share it. After that a
request's decode state only looks up mask ids: the hot path never walks the
vocabulary. A lock makes "once" hold when several threads ask at the same
time: a second compile would register its masks again, racing the first.

Without a spatial codec (``codec=None``: a text model loaded without
location tokens) the spatial skills (point, detect, segment) are not
compiled, and a request for one is refused with ``InvalidRequest``; the
text skills serve as before, over the whole vocabulary.

``request(name, **args)`` validates arguments (``InvalidRequest`` naming the
field), encodes the prompt, and returns a ``core.values.Request`` whose
``decode_state`` factory starts the skill's machine and whose ``finisher``
assembles its result.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import attrs

from bubblefree.core.values import (GREEDY, ImageRef, InvalidRequest, Request, SamplingParams, bad_prompt_values,
                                   described, integer, message, shown)
from bubblefree.skills.base import Skill, SkillError, SkillState, StateFactory, invalid
from bubblefree.skills.codec import LocationCodec, SpatialCodec
from bubblefree.skills.registry import BUILTIN, Registry
from bubblefree.skills.templates import templates_of
from bubblefree.skills.tokenizer import Tokenizer


@attrs.define
class SkillSet:
    tokenizer: Tokenizer
    register_mask: Callable[[frozenset[int]], int]
    # Default: the location tokens the tokenizer holds (CodecError if it
    # lacks them). Pass None for a model with no spatial codec at all.
    codec: SpatialCodec | None = attrs.field(default=attrs.Factory(
        lambda self: LocationCodec.for_tokenizer(self.tokenizer), takes_self=True))
    registry: Registry = BUILTIN
    _mask_ids: dict[frozenset[int], int] = attrs.field(init=False, factory=dict)
    _allowed: dict[int, frozenset[int]] = attrs.field(init=False, factory=dict)
    _tables: dict[str, Any] = attrs.field(init=False, factory=dict)
    _text_ids: frozenset[int] | None = attrs.field(init=False, default=None)
    # Reentrant: a skill's compile may ask another skill's tables.
    _compiling: threading.RLock = attrs.field(init=False, factory=threading.RLock, repr=False, eq=False)
    # Set by ``compile_all``: no mask is registered after it (``mask``).
    _sealed: bool = attrs.field(init=False, default=False)

    # -- the CompileContext skills see ---------------------------------------

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def mask(self, allowed: frozenset[int]) -> int:
        allowed = frozenset(map(integer, allowed))  # numpy's integers are ids too
        if not allowed:
            # An empty mask would leave sampling nothing to pick.
            raise SkillError("a skill state allows no token at all")
        mask_id = self._mask_ids.get(allowed)
        if mask_id is None:
            if self._sealed:
                # Once the engine serves, a new mask would be registered on a
                # caller's or the decode thread mid-tick (on CUDA: a new table
                # row, perhaps the sampling graphs captured again), and masks
                # are never freed: one a request would grow without bound.
                raise SkillError("a mask is registered only while the skills compile, before the engine "
                                 "serves: build every allowed set in compile()")
            mask_id = self.register_mask(allowed)
            self._mask_ids[allowed] = mask_id
            self._allowed[mask_id] = allowed
        return mask_id

    def text_ids(self) -> frozenset[int]:
        if self._text_ids is None:
            spatial = self.codec.spatial_ids() if self.codec is not None else frozenset()
            self._text_ids = frozenset(range(len(self.tokenizer))) - spatial
        return self._text_ids

    # -- compile once --------------------------------------------------------

    def serves(self, name: str) -> bool:
        """Whether skill ``name`` can run here (a spatial one needs a codec;
        see ``Skill.unserved``)."""
        return self._unserved(name) is None

    def _unserved(self, name: str) -> str | None:
        skill = self.registry.get(name)
        return _hook(name, "unserved", skill.unserved, self.codec)

    def tables(self, name: str) -> Any:
        # Not a str: refused by the registry naming the skill (a list, unhashable, raised TypeError here).
        if isinstance(name, str) and name in self._tables:  # None too: a skill without tables compiles once
            return self._tables[name]
        why = self._unserved(name)
        if why is not None:
            raise invalid(name, "skill", why)
        with self._compiling:
            if name in self._tables:  # another thread compiled it while this one waited
                return self._tables[name]
            try:
                tables = self.registry.get(name).compile(self)
            except Exception as err:  # noqa: BLE001 - the skill's code: named, its error chained
                raise SkillError(f"skill {name!r} cannot compile: {described(err)}") from err
            self._tables[name] = tables
        return tables

    def compile_all(self) -> SkillSet:
        """Every skill served here compiled; no mask registered after."""
        for name in self.registry.names:
            if self.serves(name):
                self.tables(name)
        self._sealed = True
        return self

    def allowed(self, mask_id: int) -> frozenset[int]:
        """The set registered under ``mask_id`` (for tests and tools)."""
        return self._allowed[mask_id]

    def registered(self) -> dict[int, frozenset[int]]:
        """Every mask this set registered: its id, its allowed set."""
        return dict(self._allowed)

    @property
    def num_masks(self) -> int:
        return len(self._mask_ids)

    # -- requests --------------------------------------------------------------

    def request(self, name: str, *, max_tokens: int | None = None,
                sampling: SamplingParams = GREEDY, max_context: int | None = None,
                max_positions: int | None = None, adapter: str | None = None,
                tag: Any = None, image: ImageRef | None = None, **args: Any) -> Request:
        """A request for skill ``name``, about ``image`` if given (an
        ``ImageRef`` from the backend's ``image_ref``). ``max_context`` (the
        model's longest sequence) and ``max_positions`` (KV positions the
        cache holds) bound the output: a ``max_tokens`` the caller gave that
        does not fit is refused naming it; a default that does not fit is cut
        to what fits, unless the caller's own ``max_objects`` asked for more
        (named then). With moondream's prompts (``skills.templates``) caption,
        point and detect need an image, and a request without one begins
        with BOS, as the image prefix would."""
        skill = self.registry.get(name)
        tables = self.tables(name)  # first: a skill this model cannot serve is refused as such
        parsed = _hook(name, "parse_args", skill.parse_args, args)
        max_tokens = integer(max_tokens)  # numpy's integers are counts too
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            raise invalid(name, "max_tokens", f"must be an integer >= 1, got {shown(max_tokens)}")
        if image is not None and not isinstance(image, ImageRef):
            raise invalid(name, "image", f"must be an ImageRef from the backend's image_ref, "
                          f"got {type(image).__name__}")
        # A vision-language model's chat turn about an image: the ids after the image.
        about = self.tokenizer.about_image() if image is not None and getattr(
            self.tokenizer, "image_turn", None) is not None else self.tokenizer
        vocab = len(self.tokenizer)
        prompt = _hook(name, "prompt", skill.prompt, about, parsed,
                       check=functools.partial(_prompt_ids, name, vocab))
        values = _hook(name, "prompt_values", skill.prompt_values, self.tokenizer, parsed,
                       check=functools.partial(_prompt_values, name, len(prompt)))
        if values and image is None:  # the references are to an image, as in moondream's reference
            if "spatial_refs" in args:
                raise invalid(name, "spatial_refs", "refer to an image: give one")
            raise SkillError(f"skill {name!r}: prompt_values() returned values, which refer to an "
                             f"image, for a request without one")
        templates = templates_of(self.tokenizer)
        if templates is not None and image is None:
            if templates.requires_image(name):
                raise invalid(name, "image", f"is required: on this model {name} is about an image")
            if prompt[:1] != (templates.bos_id,):
                prompt = (templates.bos_id, *prompt)
        prefix = len(prompt) + (image.length if image is not None else 0)
        room, bound = output_room(prefix, max_context, max_positions)
        image_part = f" after the image's {image.length} positions" if image is not None else ""
        if room is not None and room < 1:
            raise invalid(name, "prompt", f"is {len(prompt)} tokens{image_part}; {_OWNERS[bound[0]]} "
                          f"{bound[0]} is {bound[1]}")
        if max_tokens is None:
            max_tokens = _hook(name, "budget", skill.budget, tables, parsed,
                               check=functools.partial(_count, name, "budget"))
            if room is not None and max_tokens > room:
                if "max_objects" in args:
                    raise invalid(name, "max_objects", f"{args['max_objects']} objects need up to {max_tokens} "
                                  f"tokens; after a {len(prompt)}-token prompt{image_part} the model has "
                                  f"room for {room}")
                max_tokens = room
        elif room is not None and max_tokens > room:
            raise invalid(name, "max_tokens", f"{max_tokens} after a {len(prompt)}-token prompt{image_part} "
                          f"exceeds the room of {room} tokens ({bound[0]} {bound[1]})")
        factory = functools.partial(_started, skill, tables, parsed, max_tokens)
        return Request(prompt=prompt, max_tokens=max_tokens,
                       stop_ids=_hook(name, "stop_ids", skill.stop_ids, self,
                                      check=functools.partial(_token_ids, name, "stop_ids", vocab)),
                       sampling=sampling, decode_state=factory,
                       finisher=functools.partial(finish_request, skill, factory),
                       adapter=adapter, tag=tag, skill=name, image=image, prompt_values=values)


def _hook(name: str, call: str, fn: Callable[..., Any], *args: Any,
          check: Callable[[Any], Any] | None = None) -> Any:
    """A skill's hook at submit, and ``check`` of what it returned (which
    converts it: a generator is read here, under the same guard). Its
    refusals of the caller's arguments (``InvalidRequest``) and its own
    ``SkillError`` pass as they are; any other exception is the skill's
    bug, named with the skill and the hook."""
    try:
        answer = fn(*args)
        return answer if check is None else check(answer)
    except (InvalidRequest, KeyboardInterrupt, SystemExit):
        raise
    except SkillError as err:
        if message(err).startswith(f"skill {name!r}"):  # ours, naming the skill already
            raise
        raise SkillError(f"skill {name!r} raised SkillError in {call}: {message(err)}") from err
    except BaseException as err:  # noqa: BLE001 - a sync hook's CancelledError is its own bug too
        raise SkillError(f"skill {name!r} raised {type(err).__name__} in {call}: {message(err)}") from err


def _token_ids(name: str, call: str, vocab: int, ids: Any) -> tuple[int, ...]:
    """A hook's token ids as plain ints (numpy's are ids too). One outside
    the vocabulary is the skill's bug: left to the core, it was refused as
    the caller's ``prompt`` or ``stop_ids``, naming no skill."""
    if ids is None:
        raise SkillError(f"skill {name!r}: {call}() returned None, not token ids")
    ids = tuple(map(integer, ids))
    bad = [t for t in ids if type(t) is not int or not 0 <= t < vocab]
    if bad:
        raise SkillError(f"skill {name!r}: {call}() returned {bad[0]!r:.40}, not a token id in [0, {vocab})")
    return ids


def _prompt_ids(name: str, vocab: int, ids: Any) -> tuple[int, ...]:
    """``prompt()``'s ids (``_token_ids``): at least one. Empty, it was
    refused as the caller's prompt, naming no skill."""
    ids = _token_ids(name, "prompt", vocab, ids)
    if not ids:
        raise SkillError(f"skill {name!r}: prompt() returned no token")
    return ids


def _prompt_values(name: str, prompt_len: int, values: Any) -> tuple:
    """``prompt_values()``'s ``PromptValue``s, checked as the core checks
    them (``bad_prompt_values``). Left to the core, a bad one was refused
    as the caller's ``prompt_values``, a field no caller sends."""
    values = tuple(values)
    why = bad_prompt_values(values, prompt_len, values_ok=True)  # the region head: the core's to judge
    if why is not None:
        raise SkillError(f"skill {name!r}: prompt_values() returned a bad value: {why}")
    return values


def _count(name: str, call: str, answer: Any) -> int:
    """A hook's count of tokens: an integer >= 1, numpy's too."""
    answer = integer(answer)
    if type(answer) is not int or answer < 1:
        raise SkillError(f"skill {name!r}: {call}() returned {answer!r:.40}, not an integer >= 1")
    return answer


def _started(skill: Skill, tables: Any, parsed: Any, max_tokens: int) -> SkillState:
    """``skill.start(...)``, refused unless it is a decode state: without one
    the core would run the request unconstrained (a None state is a plain
    request's). Raised here, it fails this request only, naming the skill."""
    state = skill.start(tables, parsed, max_tokens)
    missing = [name for name in ("mask_id", "advance") if not callable(getattr(state, name, None))]
    if missing:
        raise SkillError(f"start() returned {type(state).__name__}, not a decode state (no callable "
                         f"{' or '.join(missing)})")
    # What the finisher reads: missing, the request would run its whole
    # budget and only then fail.
    missing = [name for name in ("consumed", "done") if not hasattr(state, name)]
    if missing:
        raise SkillError(f"start() returned {type(state).__name__}, a decode state without "
                         f"{' or '.join(missing)} (a SkillState has both)")
    # A state handed to two requests would advance on both their tokens and
    # merge their outputs. One that has consumed tokens already is caught
    # here; one that another live request holds though it has consumed none
    # (both admitted before either commits), by the core at admission.
    if state.consumed != 0:
        raise SkillError(f"start() returned a state that has consumed {state.consumed!r:.40} tokens: "
                         f"each request needs a fresh state")
    # Done before its first token, it would be sampled one anyway and then
    # refuse it, named as a bug in advance.
    if state.done:
        raise SkillError("start() returned a state that is already done: a request samples at least "
                         "one token")
    return state


# Who sets each bound on a request's length, as a refusal names it.
_OWNERS = {"max_context": "the model's", "max_positions": "the KV cache's"}


def output_room(prompt_len: int, max_context: int | None,
                max_positions: int | None) -> tuple[int | None, tuple[str, int] | None]:
    """Output tokens that fit after the prompt, and the bound that sets
    them as ``(its name, its value)``, for a refusal to name the one that
    was exceeded: the context, or the KV cache (the last output token is
    never written back, hence the + 1). On a tie, the context."""
    rooms = []
    if max_context is not None:
        rooms.append((max_context - prompt_len, ("max_context", max_context)))
    if max_positions is not None:
        rooms.append((max_positions - prompt_len + 1, ("max_positions", max_positions)))
    return min(rooms, key=lambda r: r[0]) if rooms else (None, None)


def build_request(skills: SkillSet, name: str, **kwargs: Any) -> Request:
    """``skills.request(name, **kwargs)``: see ``SkillSet.request``."""
    return skills.request(name, **kwargs)


def finish_request(skill: Skill, factory: StateFactory, tokens: tuple[int, ...],
                   state: SkillState | None) -> Any:
    """The ``Request.finisher``: the skill's result from its state.

    The state may lag the tokens: an engine may end a request on a stop id
    or a cap without advancing the state on that last token, or end it
    before the state was built. The missing tokens are replayed (without
    spatial values, which only a region head supplies); replay stops at the
    first token the machine refuses, so the result keeps whole objects only.

    A request that ended before it started (cancelled while queued, or its
    ``start`` raised at admission) has nothing to finish: if ``start``
    raises here too, its output is None and the request keeps its own
    status (cancelled; or failed, with the first cause).
    """
    if state is None:
        try:
            state = factory()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - start's bug (its CancelledError too), named at admission
            if tokens:
                raise
            return None
    for token in tokens[state.consumed:]:
        if state.done:
            break
        try:
            state.advance(token, None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - refused, or the skill's bug (which failed the request then)
            break
    return skill.finish(state)
