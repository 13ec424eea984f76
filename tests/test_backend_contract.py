"""The backend contract (core/protocol.py), run against both backends: the
simulated GPU and the CUDA backend on whatever device torch has (the CPU in
CI). What passes here for the fake holds for the real backend too.

- the legal call order gives one token per row, in the vocabulary;
- every call outside ``SLOT_CALLS`` raises ``ProtocolMisuse`` naming the
  hazard and changes nothing: the slot's legal way on still works (I4);
- every plan ``check_plan`` refuses is refused before anything runs, with a
  message naming the field, and the slot stays free;
- sample plans and masks are validated the same way by both;
- IMAGE_PREFILL rows and values run where the capacity says so
  (``Capacity.images`` / ``values``) and are refused, before anything runs,
  where it does not: the CUDA text backend has neither.
"""

from __future__ import annotations

from itertools import count

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bubblefree.core.protocol import (
    SLOT_CALLS, WHY_ILLEGAL, Backend, PlanRejected, ProtocolMisuse, SlotState,
)
from bubblefree.core.values import (
    ImageRef, InvalidRequest, SamplePlan, SamplingParams, StepFailed, StepKind, StepPlan, StepRow, ValueKind,
    bad_value,
)
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.moondream.backend import MoondreamBackend
from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.weights import random_model
from bubblefree.cuda_backend.tiny import tiny_model
from bubblefree.fake_backend import FakeBackend, FakeModel, Fault, HardwareMisuse

# One capacity for both, small enough that the CUDA backend runs a step on
# the CPU in milliseconds.
CAP = dict(page_size=4, num_pages=32, max_rows=4, max_seqs=8, max_prefill_tokens=24, max_context=48)
VOCAB = 128  # tiny_model's


@attrs.define
class Kit:
    """A fresh backend, how to read a slot's state, and how to make the next
    finalize fail on the device."""

    backend: Backend
    name: str
    state: object  # (slot) -> SlotState
    fail_next_finalize: object  # (step_id) -> None
    step_ids: count = attrs.Factory(count)

    def next_id(self) -> int:
        return next(self.step_ids)  # the fake wants rising step ids; CUDA does not care


def fake_kit() -> Kit:
    be = FakeBackend(model=FakeModel(vocab_size=VOCAB), num_adapter_slots=0, **CAP)

    def fail(step_id):
        be.faults = {**be.faults, step_id: Fault("finalize", "sampling broke")}
    return Kit(be, "fake", lambda slot: be.slots[slot].state, fail)


# On a GPU the CUDA kit runs there: real streams, events and pinned buffers.
# Graph capture stays off so the fault injection below reaches sampling (a
# replayed graph would not call the replaced method).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", device=DEVICE)


@pytest.fixture(scope="module")
def moondream():
    return random_model(tiny_config(), device=DEVICE)


def cuda_kit(model, backend=CudaBackend, **capacity) -> Kit:
    be = backend(model, min_graph_context=8, use_graphs=False, **{**CAP, **capacity})

    def fail(step_id):
        def broken(*args):
            del be._sample  # once: the class's own sampling serves the next step
            raise RuntimeError("sampling broke")
        be._sample = broken
    return Kit(be, "cuda", lambda slot: be._slots[slot].state, fail)


@pytest.fixture(params=["fake", "cuda", "moondream"])
def kit(request):
    if request.param == "fake":
        return fake_kit()
    if request.param == "moondream":  # its text steps; the same vocabulary as tiny_model's
        return cuda_kit(request.getfixturevalue("moondream"), MoondreamBackend)
    return cuda_kit(request.getfixturevalue("llama"))


def prow(seq, prompt=(1, 2, 3), pages=None, row_slot=None, position=0, **kw):
    pages = (2 * seq, 2 * seq + 1) if pages is None else pages
    return StepRow(seq_id=seq, row_slot=seq if row_slot is None else row_slot, tokens=tuple(prompt),
                   position=position, pages=tuple(pages), **kw)


def drow(seq, position, pages=None, row_slot=None):
    return prow(seq, (), pages, row_slot, position)


def prefill(step_id, *rows):
    return StepPlan(step_id=step_id, kind=StepKind.PREFILL, rows=tuple(rows))


def decode(step_id, *rows):
    return StepPlan(step_id=step_id, kind=StepKind.DECODE, rows=tuple(rows))


def image_prefill(step_id, *rows):
    return StepPlan(step_id=step_id, kind=StepKind.IMAGE_PREFILL, rows=tuple(rows))


def irow(seq, length=3, prompt=(1, 2), pages=None, source=7, **kw):
    return prow(seq, prompt, pages, image=ImageRef(length, source=source), **kw)


def unmasked(plan):
    return SamplePlan(plan.step_id, (None,) * len(plan.rows))


def serve(kit, slot=0, plan=None):
    """One whole step in the legal order; returns its output."""
    be = kit.backend
    plan = plan or prefill(kit.next_id(), prow(0))
    be.launch(slot, plan)
    be.finalize(slot, unmasked(plan))
    out = be.wait(slot)
    be.release(slot)
    return out


# -------------------------------------------------------------- legal order
def test_satisfies_the_protocol_with_the_capacity_it_was_given(kit):
    assert isinstance(kit.backend, Backend)
    cap = kit.backend.capacity
    assert {k: getattr(cap, k) for k in CAP} == CAP and kit.backend.vocab_size == VOCAB


def test_the_legal_order_gives_one_token_per_row_in_both_slots(kit):
    be = kit.backend
    first = prefill(kit.next_id(), prow(0), prow(1, (4, 5)), prow(2, (6,)))
    be.launch(0, first)
    assert kit.state(0) is SlotState.LAUNCHED
    be.finalize(0, unmasked(first))
    assert kit.state(0) is SlotState.FINALIZED
    # Pipelined: the decode's input is the token just sampled, read on the device.
    second = decode(kit.next_id(), drow(0, 3), drow(1, 2), drow(2, 1))
    be.launch(1, second)
    out = be.wait(0)
    assert kit.state(0) is SlotState.WAITED
    be.release(0)
    be.finalize(1, unmasked(second))
    out2 = be.wait(1)
    be.release(1)
    assert [kit.state(i) for i in (0, 1)] == [SlotState.FREE, SlotState.FREE]
    for plan, o in ((first, out), (second, out2)):
        assert o.step_id == plan.step_id and len(o.tokens) == len(plan.rows)
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in o.tokens)


# ------------------------------------------------------------- slot misuse
def to_state(kit, state):
    """Bring slot 0 to ``state`` by legal calls; returns its plan."""
    be = kit.backend
    if state is SlotState.FREE:
        return None
    plan = prefill(kit.next_id(), prow(0))
    if state is SlotState.FAILED:
        kit.fail_next_finalize(plan.step_id)
    be.launch(0, plan)
    if state is SlotState.FAILED:
        with pytest.raises(StepFailed, match="sampling broke"):
            be.finalize(0, unmasked(plan))
    if state in (SlotState.FINALIZED, SlotState.WAITED):
        be.finalize(0, unmasked(plan))
    if state is SlotState.WAITED:
        be.wait(0)
    assert kit.state(0) is state
    return plan


def finish(kit, state, plan):
    """The rest of the legal way from ``state`` to FREE, then one whole step:
    it works only if the slot really is in ``state`` and the backend serves."""
    be = kit.backend
    if state is SlotState.LAUNCHED:
        be.finalize(0, unmasked(plan))
    if state in (SlotState.LAUNCHED, SlotState.FINALIZED):
        be.wait(0)
    if state is not SlotState.FREE:
        be.release(0)
    assert len(serve(kit).tokens) == 1


CALLS = {
    "launch": lambda kit, plan: kit.backend.launch(0, prefill(kit.next_id(), prow(3))),
    "finalize": lambda kit, plan: kit.backend.finalize(0, unmasked(plan or prefill(0, prow(0)))),
    "wait": lambda kit, plan: kit.backend.wait(0),
    "release": lambda kit, plan: kit.backend.release(0),
}


@pytest.mark.parametrize("state", list(SlotState))
@pytest.mark.parametrize("call", sorted(CALLS))
def test_every_slot_call_is_in_the_table_or_a_misuse_that_changes_nothing(kit, state, call):
    plan = to_state(kit, state)
    if (state, call) in SLOT_CALLS:
        CALLS[call](kit, plan)
        assert kit.state(0) is SLOT_CALLS[(state, call)]
        return
    log = list(getattr(kit.backend, "log", ()))
    with pytest.raises(ProtocolMisuse) as err:
        CALLS[call](kit, plan)
    assert str(err.value) == f"slot 0: {call!r} not allowed in {state.name}: {WHY_ILLEGAL[(state, call)]}"
    assert kit.state(0) is state and list(getattr(kit.backend, "log", ())) == log
    finish(kit, state, plan)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.tuples(st.sampled_from(sorted(CALLS)), st.integers(0, 1)), max_size=20))
@pytest.mark.parametrize("name", ["fake", "cuda"])
def test_random_call_sequences_follow_the_table(llama, name, calls):
    kit = fake_kit() if name == "fake" else cuda_kit(llama)
    be = kit.backend
    shadow, plans = [SlotState.FREE, SlotState.FREE], [None, None]
    for n, (call, slot) in enumerate(calls):
        expected = SLOT_CALLS.get((shadow[slot], call))
        plan = plans[slot]
        if call == "launch":
            plan = prefill(kit.next_id(), prow(n % 8, (n % 5 + 1, 4)))
            act = lambda: be.launch(slot, plan)  # noqa: E731
        elif call == "finalize":
            act = lambda: be.finalize(slot, unmasked(plan or prefill(0, prow(0))))  # noqa: E731
        else:
            act = lambda: getattr(be, call)(slot)  # noqa: E731
        if expected is None:
            with pytest.raises(ProtocolMisuse):
                act()
        else:
            act()
            plans[slot] = plan
            shadow[slot] = expected
        assert [kit.state(i) for i in (0, 1)] == shadow


def test_release_without_wait_is_a_misuse_in_both_backends(kit):
    # The one rule the backends once disagreed on: a commit must have read
    # the slot (wait) before it is handed back (I4).
    plan = to_state(kit, SlotState.FINALIZED)
    with pytest.raises(ProtocolMisuse, match="host copy may be in flight"):
        kit.backend.release(0)
    finish(kit, SlotState.FINALIZED, plan)


def test_release_twice_is_a_misuse(kit):
    serve(kit)
    with pytest.raises(ProtocolMisuse, match="holds no step"):
        kit.backend.release(0)
    serve(kit)


@pytest.mark.parametrize("slot", [2, -1, None, "0", True])
@pytest.mark.parametrize("call", ["launch", "finalize", "wait", "release"])
def test_a_slot_that_does_not_exist_is_a_misuse(kit, slot, call):
    be = kit.backend
    args = {"launch": (prefill(kit.next_id(), prow(0)),), "finalize": (SamplePlan(0, (None,)),)}
    with pytest.raises(ProtocolMisuse, match="slot must be 0 or 1"):
        getattr(be, call)(slot, *args.get(call, ()))
    serve(kit, 1)


def test_the_fake_raises_its_own_misuse_type(kit):
    # The fake's misuse stops a test (AssertionError); both are ProtocolMisuse.
    with pytest.raises(ProtocolMisuse) as err:
        kit.backend.wait(0)
    assert isinstance(err.value, HardwareMisuse) == (kit.name == "fake")


# --------------------------------------------------------------- bad plans
BAD_PLANS = {  # name: (plan, what the message must say)
    "no rows": (prefill(0), "no rows"),
    "too many rows": (prefill(0, *(prow(i, pages=(i,)) for i in range(5))), "5 rows, the backend takes 1..4"),
    "prefill budget": (prefill(0, *(prow(i, (1,) * 9, pages=(3 * i, 3 * i + 1, 3 * i + 2))
                                    for i in range(3))), "27 prefill tokens"),
    "seq twice": (prefill(0, prow(0), prow(0, pages=(4, 5), row_slot=3)), "seq 0 appears twice"),
    "row slot out of range": (prefill(0, prow(0, row_slot=8)), "row_slot 8 out of range"),
    "row slot shared": (prefill(0, prow(0, row_slot=5), prow(1, row_slot=5)), "row_slot 5 shared"),
    "prefill row without tokens": (prefill(0, drow(0, 0)), "needs its prompt"),
    "decode row with tokens": (decode(0, prow(0, (1,), position=3)), "tokens must be"),
    "token past the vocabulary": (prefill(0, prow(0, (1, 128))), r"vocabulary \[0, 128\)"),
    "negative token": (prefill(0, prow(0, (-1, 2))), "vocabulary"),
    "past the context": (prefill(0, prow(0, (1,) * 20, pages=tuple(range(12)), position=30)),
                         "outside the context of 48"),
    "decode past the context": (decode(0, drow(0, 48, pages=tuple(range(13)))), "outside the context"),
    "negative position": (decode(0, drow(0, -1)), "outside the context"),
    "page out of range": (prefill(0, prow(0, pages=(0, 32))), r"page ids must be in \[0, 32\)"),
    "negative page": (prefill(0, prow(0, pages=(-1, 1))), "page ids"),
    "page twice in a table": (prefill(0, prow(0, (1,) * 5, pages=(3, 3))), "twice in one page table"),
    "pages shared by rows": (prefill(0, prow(0, pages=(0, 1)), prow(1, pages=(1, 2))),
                             r"pages \[1\] shared with another row"),
    "write beyond pages": (prefill(0, prow(0, (1,) * 5, pages=(0,))), "beyond its 1 pages of 4"),
    "adapter slot out of range": (prefill(0, prow(0, adapter_slot=0)), "adapter_slot 0 out of range"),
    "sampling of the wrong type": (prefill(0, prow(0, sampling=None)), "sampling must be"),
    "not a plan": ("prefill", "launch takes a StepPlan"),
}


@pytest.mark.parametrize("name", sorted(BAD_PLANS))
def test_bad_plans_are_refused_before_anything_runs(kit, name):
    be = kit.backend
    plan, why = BAD_PLANS[name]
    if isinstance(plan, StepPlan):
        plan = attrs.evolve(plan, step_id=kit.next_id())
    with pytest.raises(ProtocolMisuse, match=why) as err:
        be.launch(0, plan)
    assert kit.state(0) is SlotState.FREE
    if kit.name == "fake":  # a misuse: stop the test; nothing reached the simulated device
        assert isinstance(err.value, HardwareMisuse) and be.log == [] and be.memory.kv == {}
    else:  # the engine fails the step's rows and serves on; a direct caller sees bad input
        assert isinstance(err.value, PlanRejected)
        assert isinstance(err.value, StepFailed) and isinstance(err.value, InvalidRequest)
    serve(kit)  # still serves, from the same slot


def test_a_plan_at_the_capacity_is_served(kit):
    rows = [prow(0, (1,) * 12, pages=(0, 1, 2)), prow(1, (1,) * 12, pages=(3, 4, 5))]
    assert len(serve(kit, plan=prefill(kit.next_id(), *rows)).tokens) == 2
    pages = tuple(range(20, 32))
    serve(kit, 1, prefill(kit.next_id(), prow(7, (1,) * 24, pages=pages)))
    last = prefill(kit.next_id(), prow(7, (2,) * 24, pages=pages, position=24))
    assert len(serve(kit, 1, last).tokens) == 1  # up to the last position of the context


# ------------------------------------------------------ sample plans, masks
@pytest.mark.parametrize("sample, why", [
    (lambda plan: SamplePlan(plan.step_id + 1, (None,)), "into a slot holding step"),
    (lambda plan: SamplePlan(plan.step_id, (None, None)), "2 mask ids for 1 rows"),
    (lambda plan: SamplePlan(plan.step_id, (99,)), "mask id 99 was never registered"),
    (lambda plan: (None,), "finalize takes a SamplePlan"),
])
def test_a_bad_sample_plan_is_a_misuse_and_the_slot_stays_launched(kit, sample, why):
    plan = to_state(kit, SlotState.LAUNCHED)
    with pytest.raises(ProtocolMisuse, match=why):
        kit.backend.finalize(0, sample(plan))
    assert kit.state(0) is SlotState.LAUNCHED
    finish(kit, SlotState.LAUNCHED, plan)


@pytest.mark.parametrize("allowed, why", [
    (frozenset(), "empty"), (frozenset({128}), "outside the vocabulary"),
    (frozenset({-1, 3}), "outside the vocabulary"), (frozenset({"a"}), "outside the vocabulary"),
])
def test_register_mask_refuses_sets_that_cannot_be_sampled(kit, allowed, why):
    with pytest.raises(PlanRejected, match=why) as err:
        kit.backend.register_mask(allowed)
    assert isinstance(err.value, ValueError)


def test_masks_are_deduplicated_and_obeyed(kit):
    be = kit.backend
    small, other = be.register_mask(frozenset({5, 9})), be.register_mask(frozenset({77}))
    assert be.register_mask(frozenset({9, 5})) == small != other
    plan = prefill(kit.next_id(), prow(0), prow(1, sampling=SamplingParams(1.0, 1.0, 3)), prow(2))
    be.launch(0, plan)
    be.finalize(0, SamplePlan(plan.step_id, (small, small, other)))
    out = be.wait(0)
    be.release(0)
    assert out.tokens[0] in {5, 9} and out.tokens[1] in {5, 9} and out.tokens[2] == 77


# ---------------------------------------------------------- images, values
def image_of(kit):
    """An ImageRef the backend made from a small picture (where it takes images)."""
    from PIL import Image
    return kit.backend.image_ref(Image.new("RGB", (8, 6), (200, 30, 90)))


def test_the_capacity_says_whether_images_and_values_run(kit):
    cap = kit.backend.capacity
    if kit.name == "fake":
        assert cap.images and cap.values
    if type(kit.backend) is CudaBackend:  # a transformers text model: no image prefix, no region head
        assert not cap.images and not cap.values
    # A backend that takes images makes their refs (the user API calls it at submit).
    assert callable(getattr(kit.backend, "image_ref", None)) == cap.images


# moondream2's image prefix is 730 positions, past the suite's small capacity:
# its image prefill runs on a backend of the same class sized for two of them.
WIDE = dict(page_size=16, num_pages=128, max_prefill_tokens=1536, max_context=800)


def test_an_image_prefill_then_decodes_in_the_legal_order(kit, request):
    be = kit.backend
    if not be.capacity.images:
        plan = image_prefill(kit.next_id(), irow(0, pages=(10, 11, 12)))
        with pytest.raises(ProtocolMisuse, match="image_prefill step on a backend without images"):
            be.launch(0, plan)
        assert kit.state(0) is SlotState.FREE
        serve(kit)
        return
    if image_of(kit).length + 3 > CAP["max_prefill_tokens"] // 2:
        kit = cuda_kit(request.getfixturevalue("moondream"), type(be), **WIDE)
    cap = kit.backend.capacity
    ref = image_of(kit)
    assert 2 * ref.length + 3 <= cap.max_prefill_tokens  # both rows fit: nothing is skipped
    n_pages = -(-(ref.length + 3) // cap.page_size)
    first, second = tuple(range(10, 10 + n_pages)), tuple(range(10 + n_pages, 10 + 2 * n_pages))
    rows = (attrs.evolve(irow(0, pages=first), image=ref),
            attrs.evolve(irow(1, prompt=(5,), pages=second), image=ref))
    out = serve(kit, plan=image_prefill(kit.next_id(), *rows))  # one image in two rows: each writes its own prefix
    assert len(out.tokens) == 2 and out.values in (None, (None, None))
    step = decode(kit.next_id(), drow(0, ref.length + 2, pages=first), drow(1, ref.length + 1, pages=second))
    assert len(serve(kit, 1, step).tokens) == 2


BAD_IMAGE_PLANS = {  # name: (plan, what the message must say where the backend takes images)
    "image prefill row without an image": (image_prefill(0, prow(0)), "needs an ImageRef"),
    "image of length 0": (image_prefill(0, irow(0, 0)), "int length > 0"),
    "image length not an int": (image_prefill(0, irow(0, 2.0)), "int length > 0"),
    "image length a bool": (image_prefill(0, irow(0, True)), "int length > 0"),
    "image not an ImageRef": (image_prefill(0, attrs.evolve(prow(0), image=3)), "needs an ImageRef"),
    "image prefill row without a prompt": (image_prefill(0, irow(0, prompt=())), "needs its prompt"),
    "image prefix over the prefill budget": (image_prefill(0, irow(0, 20, (1,) * 5, pages=tuple(range(7)))),
                                             "25 prefill tokens"),
    "image prefix beyond the pages": (image_prefill(0, irow(0, 6, (1, 2, 3))), "writes position 8, beyond"),
    "image prefix past the context": (image_prefill(0, irow(0, 10, (1,) * 9, pages=tuple(range(13)), position=30)),
                                      "positions 30..48 outside the context of 48"),
}
TEXT_ROWS_WITH_IMAGES = {
    "prefill row with an image": (prefill(0, irow(0)), "a prefill row carries no image"),
    "decode row with an image": (decode(0, attrs.evolve(drow(0, 3), image=ImageRef(1))),
                                 "a decode row carries no image"),
}


@pytest.mark.parametrize("name", sorted(BAD_IMAGE_PLANS) + sorted(TEXT_ROWS_WITH_IMAGES))
def test_bad_image_plans_are_refused_before_anything_runs(kit, name):
    plan, why = BAD_IMAGE_PLANS.get(name) or TEXT_ROWS_WITH_IMAGES[name]
    if plan.kind is StepKind.IMAGE_PREFILL and not kit.backend.capacity.images:
        why = "without images"
    BAD_PLANS[name] = (plan, why)
    try:
        test_bad_plans_are_refused_before_anything_runs(kit, name)
    finally:
        del BAD_PLANS[name]


def asked(plan, values):
    return SamplePlan(plan.step_id, (None,) * len(plan.rows), tuple(values))


@pytest.mark.parametrize("values, why", [
    ((ValueKind.COORD, None), "values must be \\(\\) or one entry per row \\(1\\)"),
    (("coord",), "must be a ValueKind or None"),
    ((1,), "must be a ValueKind or None"),
])
def test_a_bad_values_plan_is_a_misuse_and_the_slot_stays_launched(kit, values, why):
    plan = to_state(kit, SlotState.LAUNCHED)
    with pytest.raises(ProtocolMisuse, match=why):
        kit.backend.finalize(0, asked(plan, values))
    assert kit.state(0) is SlotState.LAUNCHED
    finish(kit, SlotState.LAUNCHED, plan)


@pytest.mark.parametrize("kind", list(ValueKind))
def test_values_are_decoded_where_asked_and_refused_without_a_region_head(kit, kind):
    be = kit.backend
    plan = prefill(kit.next_id(), prow(0), prow(1, (4, 5)), prow(2, (6,)))
    be.launch(0, plan)
    if not be.capacity.values:
        with pytest.raises(ProtocolMisuse, match=f"a {kind.value} value asked of a backend without a region head"):
            be.finalize(0, asked(plan, (None, kind, None)))
        assert kit.state(0) is SlotState.LAUNCHED
        finish(kit, SlotState.LAUNCHED, plan)
        return
    be.finalize(0, asked(plan, (None, kind, None)))
    out = be.wait(0)
    be.release(0)
    assert len(out.values) == 3 and out.values[0] is None and out.values[2] is None
    assert bad_value(kind, out.values[1]) is None  # I13: its kind's shape and range
    # The value row decodes on: its next input is the value's encoding, on the device.
    assert len(serve(kit, 1, decode(kit.next_id(), drow(0, 3), drow(1, 2), drow(2, 1))).tokens) == 3


def test_no_value_asked_is_the_plain_sample_plan(kit):
    plan = prefill(kit.next_id(), prow(0))
    kit.backend.launch(0, plan)
    kit.backend.finalize(0, asked(plan, (None,)))  # one None per row: allowed anywhere
    out = kit.backend.wait(0)
    kit.backend.release(0)
    assert out.values in (None, (None,))
