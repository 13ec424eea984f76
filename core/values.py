"""Values that cross a boundary: requests in, plans to the backend, results out.

All are frozen ``attrs`` values (STYLE.md): once a plan is handed to a backend
nobody can change it under the backend's feet, and a result handed to a
caller cannot be edited by the engine afterwards.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Mapping

import attrs


class StepKind(enum.Enum):
    """What a step computes. Both kinds share the two DecodeSlots (seed)."""

    PREFILL = "prefill"  # a one-shot forward over each row's prompt
    DECODE = "decode"  # one token per row; its input is read on the device


class Status(enum.Enum):
    """How a request ended (I7: exactly one of these, exactly once)."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class InvalidRequest(ValueError):
    """A request the engine refuses at ``submit``; the message names the field.

    A refused request was never accepted, so I7 does not apply to it.
    """


class StepFailed(RuntimeError):
    """Raised by a backend when a step's forward, sampling or copy fails.

    The step's rows fail with ``reason``; the engine keeps serving.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _number(field: str, low: float, high: float, zero_ok: bool = False):
    """An attrs converter: a real number (bool refused) in [low, high], as a
    float, so an int temperature samples exactly like the same float does."""
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"sampling.{field}: must be a number, got {value!r}")
        value = float(value)
        if not (low <= value <= high or (zero_ok and value == 0.0)):
            allowed = f"0 or in [{low:g}, {high:g}]" if zero_ok else f"in [{low:g}, {high:g}]"
            raise InvalidRequest(f"sampling.{field}: must be {allowed}, got {value!r}")
        return value
    return convert


def _seed(value):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise InvalidRequest(f"sampling.seed: must be an int in [0, 2**64), got {value!r}")
    return value


@attrs.frozen
class SamplingParams:
    """Greedy when ``temperature == 0``. Seeded per request and position, so a
    row's token never depends on who shares its batch (I8 with sampling on).

    Values are checked and normalized here, where they enter: a backend
    computes in float32, so an infinite, NaN or denormal-small temperature
    (or top_p) would turn into inf, NaN or 0 on the device and sample
    something the mask does not allow (I9), or differ between backends.
    """

    temperature: float = attrs.field(default=0.0, converter=_number("temperature", 1e-5, 100.0, True))
    top_p: float = attrs.field(default=1.0, converter=_number("top_p", 1e-5, 1.0))
    seed: int = attrs.field(default=0, converter=_seed)

    @classmethod
    def of(cls, value: Any) -> "SamplingParams":
        """``value`` as SamplingParams: itself, a mapping of its fields, or None
        (greedy); anything else is refused naming ``sampling``."""
        if value is None:
            return GREEDY
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(map(str, set(value) - {"temperature", "top_p", "seed"}))
            if unknown:
                raise InvalidRequest(f"sampling: unknown field(s) {', '.join(unknown)}; "
                                     "expected temperature, top_p, seed")
            return cls(**value)
        raise InvalidRequest(f"sampling: must be SamplingParams or a mapping, got {type(value).__name__}")


GREEDY = SamplingParams()


@attrs.frozen
class Request:
    """What a caller submits.

    ``decode_state`` builds the request's skill state (a ``DecodeState``) when
    the request is admitted; ``None`` means unconstrained text. ``stop_ids``
    end the request (EOS); the token that ends it is kept in ``tokens``.
    ``finisher`` turns the committed tokens into the user-facing ``output``
    (a skill's result assembly); ``None`` leaves ``output`` as ``None``.
    """

    prompt: tuple[int, ...] = attrs.field(converter=tuple)
    max_tokens: int
    stop_ids: frozenset[int] = attrs.field(converter=frozenset, factory=frozenset)
    sampling: SamplingParams = GREEDY
    decode_state: Callable[[], Any] | None = None
    finisher: Callable[[tuple[int, ...], Any], Any] | None = None
    adapter: str | None = None
    tag: Any = None  # caller's own label, carried into the result untouched
    skill: str | None = None  # the skill that built it: named in the reasons of its own errors


@attrs.frozen
class Result:
    """The one final answer for an accepted request (I7)."""

    request_id: int
    status: Status
    tokens: tuple[int, ...]
    finish_reason: str  # "stop", "length", "done" (skill), "cancelled", or the failure
    output: Any = None
    tag: Any = None


@attrs.frozen
class StepRow:
    """One sequence's part of a step.

    ``row_slot`` is the sequence's persistent device index: sampling writes the
    token it draws there, and a later decode step reads its input from there
    (the token never leaves the device; seed). ``pages`` are the sequence's KV
    pages in order; the KV of position ``p`` lives in ``pages[p // page_size]``
    at offset ``p % page_size``.
    """

    seq_id: int
    row_slot: int
    tokens: tuple[int, ...]  # PREFILL: the prompt; DECODE: () (input read on the device)
    position: int  # position of the row's first input token
    pages: tuple[int, ...]
    sampling: SamplingParams = GREEDY
    adapter_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) if self.tokens else 1


@attrs.frozen
class StepPlan:
    """A forward to enqueue into one DecodeSlot (the launch phase)."""

    step_id: int
    kind: StepKind
    rows: tuple[StepRow, ...]


@attrs.frozen
class SamplePlan:
    """The finalize phase: one mask id per row of the launched step, in row
    order; ``None`` means unconstrained. Mask ids come from
    ``Backend.register_mask``. Built after the previous commit (I9)."""

    step_id: int
    mask_ids: tuple[int | None, ...]


@attrs.frozen
class StepOutput:
    """What a step's host copy holds once its event has fired: one sampled
    token per row, and a decoded spatial value per row where the model has a
    region head (``None`` elsewhere)."""

    step_id: int
    tokens: tuple[int, ...]
    values: tuple[float | None, ...] | None = None
