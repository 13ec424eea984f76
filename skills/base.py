"""The skill contract: a small decode state machine that never sees a tensor.

A skill is a frozen value with five duties, split by when they run:

    parse_args(args)            at submit: validate user arguments; raise
                                ``InvalidRequest`` naming the field
    prompt(tokenizer, args)     at submit: the prompt's token ids
    compile(ctx)                once per SkillSet (tokenizer + engine): every
                                state's allowed-token set, registered once
                                through ``ctx.mask``; returns the skill's
                                tables (mask ids and transitions)
    start(tables, args, budget) at admission: a fresh ``SkillState``
    finish(state)               at the end: the user-facing result

A ``SkillState`` is the per-request ``core.decode_state.DecodeState``:
``mask_id()`` is a table lookup (O(1): the vocabulary is never walked on the
hot path), and ``advance`` consumes one committed token. Following h11, a
token the state does not allow raises ``SkillError`` and leaves the state
unchanged; the engine checks I9 before it gets there, so a raise here means
a bug upstream, never a model's bad luck.

Budgets: ``budget`` is the request's ``max_tokens``. A state that knows an
object cannot complete within the budget does not start it, and ``finish``
drops any partial object anyway (cancels, or a cap the state never saw), so
a result only ever holds whole objects.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping, Protocol

from bubblefree.core.values import InvalidRequest, integer, named, shown
from bubblefree.skills.codec import SpatialCodec
from bubblefree.skills.tokenizer import Tokenizer


class SkillError(RuntimeError):
    """A token the skill state does not allow, or a skill that cannot compile
    for a tokenizer (say, no "yes" token)."""


class CompileContext(Protocol):
    """What a skill may use to compile (``skills.skillset.SkillSet``)."""

    tokenizer: Tokenizer
    codec: SpatialCodec | None  # None: the model has no location tokens or region head

    @property
    def eos_id(self) -> int: ...

    def mask(self, allowed: frozenset[int]) -> int:
        """Register an allowed set (once per distinct set) and return its id."""
        ...

    def text_ids(self) -> frozenset[int]:
        """Every token but the spatial ones (free text)."""
        ...


class SkillState(abc.ABC):
    """Per-request decode state; subclasses set ``consumed`` and ``done`` and
    implement ``mask_id`` and ``_step``."""

    consumed: int  # committed tokens advanced so far
    done: bool

    @abc.abstractmethod
    def mask_id(self) -> int | None: ...

    @abc.abstractmethod
    def _step(self, token: int, value: float | None) -> None:
        """Apply one token, or raise ``SkillError`` before changing anything."""

    def may_end(self) -> bool:
        """Can the next token end the output? Timing only (the engine's
        ``pipelined="auto"`` blocks before a likely end): True is always
        safe, False where the state knows better."""
        return True

    def advance(self, token: int, value: float | None = None) -> bool:
        if self.done:
            # I5: the engine appends nothing after the end, so neither do we.
            raise SkillError(f"token {token} after the output was complete")
        self._step(token, value)
        self.consumed += 1
        return self.done


class Skill(abc.ABC):
    """See the module docstring. Subclasses are ``@attrs.frozen`` values
    carrying a ``name``; they hold no per-request or per-tokenizer state.
    A ``spatial`` skill compiles against ``ctx.codec``, so a model without a
    spatial codec cannot serve it."""

    name: str
    spatial: ClassVar[bool] = False

    @abc.abstractmethod
    def parse_args(self, args: Mapping[str, Any]) -> Any: ...

    @abc.abstractmethod
    def prompt(self, tokenizer: Tokenizer, args: Any) -> list[int]: ...

    @abc.abstractmethod
    def default_max_tokens(self, args: Any) -> int: ...

    @abc.abstractmethod
    def compile(self, ctx: CompileContext) -> Any: ...

    @abc.abstractmethod
    def start(self, tables: Any, args: Any, budget: int) -> SkillState: ...

    @abc.abstractmethod
    def finish(self, state: SkillState) -> Any: ...

    def budget(self, tables: Any, args: Any) -> int:
        """The output tokens a request takes by default, knowing the compiled
        ``tables`` (a box's token count follows the codec): unless a skill
        says better, ``default_max_tokens``."""
        return self.default_max_tokens(args)

    def prompt_values(self, tokenizer: Tokenizer, args: Any) -> tuple:
        """The prompt positions whose inputs are values (``PromptValue``s,
        indices into ``prompt``'s ids): none unless a skill says so."""
        return ()

    def unserved(self, codec: SpatialCodec | None) -> str | None:
        """Why this skill cannot run on a model with ``codec``, or None."""
        if self.spatial and codec is None:
            return ("this model has no location tokens or region head, so it cannot give spatial "
                    "answers; load a text model with location_tokens=True to add them")
        return None

    def stop_ids(self, ctx: CompileContext) -> frozenset[int]:
        """EOS ends every skill; states also treat it as their end marker, so
        the result is the same whether or not the engine advances them on it."""
        return frozenset({ctx.eos_id})


# -- argument validation: every error names its field ------------------------

# The most of a refusal's field and problem kept: they quote what the
# caller sent, and a megabyte of it (a 300,000-number box, an argument name
# as long) is no clearer than its start.
FIELD_CHARS, PROBLEM_CHARS = 100, 300


def invalid(skill: str, field: str, problem: str) -> InvalidRequest:
    return InvalidRequest(f"{_cut(field, FIELD_CHARS)}: {_cut(problem, PROBLEM_CHARS)} "
                          f"(skill {skill!r})")


def _cut(text: str, most: int) -> str:
    return named(text, most)


def check_fields(skill: str, args: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for field in args:
        if field not in known:
            expected = ", ".join(known) if known else "no arguments"
            raise invalid(skill, field, f"unknown argument; expected {expected}")


def text_arg(skill: str, args: Mapping[str, Any], field: str) -> str:
    if field not in args:
        raise invalid(skill, field, "is required")
    value = args[field]
    if not isinstance(value, str):
        raise invalid(skill, field, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate: no tokenizer can encode it
        raise invalid(skill, field, f"is not valid text ({err.reason} at position {err.start})") from None
    if not value.strip():
        raise invalid(skill, field, "must not be empty")
    return value.strip()


def positive_int(skill: str, args: Mapping[str, Any], field: str, default: int) -> int:
    value = integer(args.get(field, default))  # numpy's integers too, as max_tokens takes them
    # bool is an int subclass; True objects is a caller's bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(skill, field, f"must be an integer, got {shown(value)}")
    if value <= 0:
        raise invalid(skill, field, f"must be > 0, got {value}")
    return value


def choice_arg(skill: str, args: Mapping[str, Any], field: str,
               choices: tuple[str, ...], default: str) -> str:
    value = args.get(field, default)
    # A str first: ``in`` compares with ``==``, which a numpy array answers
    # elementwise (an ambiguous truth, or a one-element array found "in").
    if not isinstance(value, str) or value not in choices:
        raise invalid(skill, field, f"must be one of {', '.join(choices)}; got {shown(value)}")
    return choices[choices.index(value)]  # the choice itself, not a subclass of str


StateFactory = Callable[[], SkillState]
