"""Values that cross a boundary: requests in, plans to the backend, results out.

All are frozen ``attrs`` values (STYLE.md): once a plan is handed to a backend
nobody can change it under the backend's feet, and a result handed to a
caller cannot be edited by the engine afterwards.
"""

from __future__ import annotations

import enum
import numbers
from functools import partial
from typing import Any, Callable, Mapping

import attrs


class StepKind(enum.Enum):
    """What a step computes. Both kinds share the two DecodeSlots (seed)."""

    PREFILL = "prefill"  # a one-shot forward over each row's prompt
    DECODE = "decode"  # one token per row; its input is read on the device
    # A prefill whose every row carries an image: the image prefix at KV
    # positions 0 .. image.length-1 (bidirectional among themselves), then the
    # prompt, causal. Sampling draws the first output token, as after PREFILL.
    IMAGE_PREFILL = "image_prefill"


class ValueKind(enum.Enum):
    """A value a row asks the region head to decode beside its token."""

    COORD = "coord"  # one float in [0, 1]: bin / 1024
    SIZE = "size"  # (width, height), each 2 ** (bin / 1023 * 10 - 10), in (0, 1]


@attrs.frozen
class PromptValue:
    """A prompt position whose input is a value's encoding instead of its
    token's embedding: moondream's spatial references (a point is two COORD
    positions, a box its centre's two COORDs then a SIZE). The token at
    ``index`` is the model's placeholder; the value must pass ``bad_value``
    for ``kind`` (I13), checked when the request is submitted."""

    index: int  # into Request.prompt (a StepRow's: into its tokens)
    kind: ValueKind
    value: Any


@attrs.frozen(eq=False)
class ImageRef:
    """An image as the core sees it: how many KV positions its prefix takes.

    ``source`` is the backend's (pixels or crops to encode, or an encoded
    image already on the device); the core never reads it. Made by the
    backend's ``image_ref``. Compared by identity: two refs to equal pixels
    are still two images to encode.
    """

    length: int  # KV positions of the prefix, > 0 (moondream2: BOS + 729 features)
    source: Any = None


class Status(enum.Enum):
    """How a request ended (I7: exactly one of these, exactly once)."""

    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


def integer(x: Any) -> Any:
    """``x`` as a plain int where it is an integer of another type (numpy's,
    say), else as it is: a bool stays a bool, refused where an id is due."""
    if type(x) is int or x is None:  # the usual answers, per row per step: no ABC check
        return x
    return int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else x


# The most of a caller's name (a field, a skill) a refusal quotes.
NAME_CHARS = 100


def named(name: Any, most: int = NAME_CHARS) -> str:
    """A name the caller sent, as a refusal quotes it: a lone surrogate
    escaped (a message holding one cannot be printed or logged) and at most
    ``most`` characters (a megabyte-long key quoted whole is no clearer)."""
    text = (name if isinstance(name, str) else repr(name)).encode("utf-8", "backslashreplace").decode()
    return text if len(text) <= most else text[:most] + "..."


def described(err: BaseException) -> str:
    """``Type: message`` for a reason a Result carries (``message``)."""
    return f"{type(err).__name__}: {message(err)}"


def message(err: BaseException) -> str:
    """``str(err)``; where that itself raises (a caller's or a skill's
    exception), what it raised. Reasons are written while requests are
    being ended, and a raise there would leave them unended."""
    try:
        return str(err)
    except BaseException as inner:  # noqa: BLE001 - any str() may raise anything
        return f"(its message raised {type(inner).__name__})"


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


def _checked_number(field: str, low: float, high: float, zero_ok: bool, value: Any) -> float:
    """An attrs converter (bound to its field with ``functools.partial``): a
    real number (bool refused) in [low, high], or 0 where ``zero_ok``, as a
    float, so an int temperature samples exactly like the same float does."""
    # Any real number (numpy's float32, a Fraction), as the caller's numbers
    # come; Decimal is not one (no ``numbers.Real``), nor is a bool.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequest(f"sampling.{field}: must be a number, got {shown(value)}")
    allowed = f"0 or in [{low:g}, {high:g}]" if zero_ok else f"in [{low:g}, {high:g}]"
    try:
        value = float(value)
    except OverflowError:  # an int (or Fraction) past a float's range: named, not a bare error
        raise InvalidRequest(f"sampling.{field}: must be {allowed}, got {too_big(value)}, "
                             "past a float's range") from None
    if not (low <= value <= high or (zero_ok and value == 0.0)):
        raise InvalidRequest(f"sampling.{field}: must be {allowed}, got {value!r}")
    return value


def shown(value: Any, most: int = NAME_CHARS) -> str:
    """A caller's value as a refusal quotes it: its repr, at most ``most``
    characters; an int past 256 bits by its digits (past 4,300 its repr
    raises); and where the repr itself raises (a caller's object), the
    value's type, so that the refusal is still the refusal."""
    if type(value) is int and value.bit_length() > 256:
        return too_big(value)
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - any object's __repr__ may raise anything
        return f"a {type(value).__name__} (its repr raised)"
    return named(text, most)


def too_big(value: Any) -> str:
    """``value`` past a float's range, as a message names it: an int by its
    digits (its repr may be thousands long, and ``str`` refuses past 4300)."""
    if not isinstance(value, int):
        return f"a {type(value).__name__} past 1e308"
    digits = int(abs(value).bit_length() * 0.30102999566398120) + 1
    if abs(value) < 10 ** (digits - 1):  # the estimate may be one over
        digits -= 1
    return f"an integer of {digits} digits"


MAX_TOP_K = (1 << 31) - 1  # past any vocabulary; a device column holds it as it is


def _top_k(value: Any) -> int:
    value = integer(value)  # numpy's integers too
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_K:
        raise InvalidRequest("sampling.top_k: must be an int in [0, 2**31 - 1] (0: no limit), "
                             f"got {shown(value)}")
    return value


def _seed(value):
    if value is None:  # a fresh one when the request is accepted (``SamplingParams.seeded``)
        return None
    value = integer(value)  # numpy's integers are seeds too
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise InvalidRequest(f"sampling.seed: must be an int in [0, 2**64) or None, got {shown(value)}")
    return value


@attrs.frozen
class SamplingParams:
    """Greedy when ``temperature == 0``. Seeded per request and position, so a
    row's token never depends on who shares its batch (I8 with sampling on).

    With a temperature the draw is from ``softmax(logits / temperature)``
    over the allowed tokens, cut in this order (as vLLM and transformers
    cut it): the ``top_k`` most likely (0: no limit), then the top-p
    nucleus of what is left, renormalized (1: no cut), then every token
    under ``min_p`` times the most likely one's probability (0: no cut).
    The most likely token always stays. Greedy ignores all three.

    ``seed`` None (the default) is a fresh one for each request, drawn
    when the engine accepts it (``seeded``; the request its Handle holds
    has it, to draw the same again), so two requests asking the same draw
    apart, as OpenAI's and vLLM's do; a seed given draws the same tokens
    every time.

    Values are checked and normalized here, where they enter: a backend
    computes in float32, so an infinite, NaN or denormal-small temperature
    (or top_p) would turn into inf, NaN or 0 on the device and sample
    something the mask does not allow (I9), or differ between backends.
    """

    temperature: float = attrs.field(default=0.0,
                                     converter=partial(_checked_number, "temperature", 1e-5, 100.0, True))
    top_p: float = attrs.field(default=1.0, converter=partial(_checked_number, "top_p", 1e-5, 1.0, False))
    seed: int | None = attrs.field(default=None, converter=_seed)
    top_k: int = attrs.field(default=0, converter=_top_k)
    min_p: float = attrs.field(default=0.0, converter=partial(_checked_number, "min_p", 1e-5, 1.0, True))

    @property
    def drawn_seed(self) -> int:
        """The seed a backend draws with: 0 for a row that reached it with
        none (a plan built by hand; the engine gives every request one)."""
        return 0 if self.seed is None else self.seed

    def seeded(self, draw: Callable[[], int]) -> "SamplingParams":
        """These values with a seed: their own, else ``draw()``'s (an int in
        [0, 2**64)) where a token is drawn, and 0 where greedy needs none."""
        if self.seed is not None:
            return self
        return attrs.evolve(self, seed=draw() if self.temperature else 0)

    @classmethod
    def of(cls, value: Any) -> "SamplingParams":
        """``value`` as SamplingParams: itself, a mapping of its fields, or None
        (greedy); anything else is refused naming ``sampling``."""
        if value is None:
            return GREEDY
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(map(named, set(value) - set(SAMPLING_FIELDS)))
            if unknown:
                raise InvalidRequest(f"sampling: unknown field(s) {', '.join(unknown)}; "
                                     f"expected {', '.join(SAMPLING_FIELDS)}")
            return cls(**value)
        raise InvalidRequest(f"sampling: must be SamplingParams or a mapping, got {type(value).__name__}")


GREEDY = SamplingParams()
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")  # as a mapping names them


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
    image: ImageRef | None = None  # prefilled before the prompt (IMAGE_PREFILL)
    prompt_values: tuple[PromptValue, ...] = attrs.field(converter=tuple, factory=tuple)

    @property
    def prefix_len(self) -> int:
        """KV positions the prefill writes: the image prefix, then the prompt."""
        return (self.image.length if self.image is not None else 0) + len(self.prompt)


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
    position: int  # position of the row's first input (an image row: of its prefix)
    pages: tuple[int, ...]
    sampling: SamplingParams = GREEDY
    adapter_slot: int | None = None
    image: ImageRef | None = None  # IMAGE_PREFILL rows only: the prefix before ``tokens``
    prompt_values: tuple[PromptValue, ...] = ()  # prefill rows: inputs that are values

    @property
    def num_tokens(self) -> int:
        """KV positions the row writes: image prefix and prompt, or one input."""
        if self.image is not None:
            return self.image.length + len(self.tokens)
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
    ``Backend.register_mask``. Built after the previous commit (I9).

    ``values`` is () when no row asks a value, else one entry per row: the
    kind the region head decodes beside that row's token, or None. A value
    row's next decode input is the value's encoding, on the device."""

    step_id: int
    mask_ids: tuple[int | None, ...]
    values: tuple[ValueKind | None, ...] = ()


Value = float | tuple[float, float]


@attrs.frozen
class StepOutput:
    """What a step's host copy holds once its event has fired: one sampled
    token per row, and ``values``: None, or one entry per row, a float for a
    COORD row, a (width, height) pair for a SIZE row, None otherwise (I13)."""

    step_id: int
    tokens: tuple[int, ...]
    values: tuple[Value | None, ...] | None = None


def bad_value(kind: ValueKind | None, value: Any) -> str | None:
    """Why ``value`` is not what a row that asked ``kind`` must get (I13), or
    None. A finite real in [0, 1] for COORD, a pair of them in (0, 1] for SIZE,
    None for a row that asked none."""
    if kind is None:
        return None if value is None else f"a value {value!r} for a row that asked none"
    if kind is ValueKind.COORD:
        return None if _coord_ok(value) else f"coord value {value!r} is not a number in [0, 1]"
    if type(value) is tuple and len(value) == 2 and _side_ok(value[0]) and _side_ok(value[1]):
        return None
    return f"size value {value!r} is not a (width, height) pair in (0, 1]"


def bad_prompt_values(values: tuple, prompt_len: int, values_ok: bool) -> str | None:
    """Why a request's ``prompt_values`` cannot be taken, or None: each a
    ``PromptValue`` at a prompt index, in increasing order, its value fit for
    its kind (``bad_value``), and only on a backend with a region head."""
    if not values:
        return None
    if not values_ok:
        return "this backend has no region head to encode values"
    last = -1
    for i, pv in enumerate(values):
        if not isinstance(pv, PromptValue):
            return f"entry {i} must be a PromptValue, got {type(pv).__name__}"
        if type(pv.index) is not int or not last < pv.index < prompt_len:
            return (f"entry {i}: index {pv.index!r} must be an int in [0, {prompt_len}), "
                    f"after the previous entry's")
        if not isinstance(pv.kind, ValueKind):
            return f"entry {i}: kind must be a ValueKind, got {pv.kind!r}"
        why = bad_value(pv.kind, pv.value)
        if why is not None:
            return f"entry {i}: {why}"
        last = pv.index
    return None


def _real(x: Any) -> bool:
    # bool is an int, but never a coordinate nor a side.
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _coord_ok(x: Any) -> bool:
    """In [0, 1]: a point may lie on the image's edge. NaN fails the comparisons."""
    return _real(x) and 0.0 <= x <= 1.0


def _side_ok(x: Any) -> bool:
    """In (0, 1]: a size's width or height; an empty box has no size."""
    return _real(x) and 0.0 < x <= 1.0
