"""Images and values through the core: the IMAGE_PREFILL step kind, the
value path (``value_kind`` at finalize, ``SamplePlan.values``, I13 at
commit), and every guard they add, hit on purpose. A guard raises naming
its invariant or field and leaves the state as it was (h11's rule).
"""

from __future__ import annotations

import attrs
import pytest

from bubblefree.core import (
    Capacity, Engine, ImageRef, InvalidRequest, InvariantViolation, Phase, PromptValue, Request, Scheduler, Sequence,
    Status, StepKind, StepOutput, ValueKind,
)
from bubblefree.core.policy import choose_step
from bubblefree.core.protocol import PlanRejected, check_plan, check_sample
from bubblefree.core.values import SamplePlan, StepPlan, StepRow, bad_value
from bubblefree.fake_backend import FakeBackend, FakeModel

CAP = Capacity(num_pages=16, page_size=2, max_rows=4, max_seqs=4, max_prefill_tokens=8, max_context=16,
               images=True, values=True)


@attrs.define(eq=False)
class Asks:
    """A free-text skill asking ``kinds`` of values in turn; keeps what it got.
    ``kind`` overrides them with anything (a bad return), ``boom`` raises."""

    kinds: tuple = (ValueKind.COORD,)
    got: list = attrs.Factory(list)
    kind: object = None
    boom: bool = False

    def mask_id(self):
        return None

    def value_kind(self):
        if self.boom:
            raise RuntimeError("no head here")
        return self.kind if self.kind is not None else self.kinds[len(self.got) % len(self.kinds)]

    def advance(self, token, value):
        self.got.append((token, value))
        return False


def image(length=3, source=5) -> ImageRef:
    return ImageRef(length, source=source)


# ------------------------------------------------------------ bookkeeping
def test_kv_len_and_admission_pages_count_the_image_prefix():
    sched = Scheduler(CAP)
    sched.add(Sequence(0, Request(prompt=(1, 2), max_tokens=4, image=image(3))))
    slot, plan = sched.plan_launch()
    seq = sched.seqs[0]
    assert len(seq.pages) == 4  # 3 + 2 + 4 - 1 = 8 positions, 2 a page
    (row,) = plan.rows
    assert plan.kind is StepKind.IMAGE_PREFILL and row.image is seq.request.image
    assert (row.tokens, row.position, row.num_tokens) == ((1, 2), 0, 5)
    sched.launched(slot, plan)
    assert seq.kv_len == 5 - 1 + 1  # the prefix and prompt written; the first output not yet
    seq.launched += 1
    assert seq.kv_len == 6


def test_image_and_text_prefills_never_share_a_step():
    sched = Scheduler(CAP)
    for i, img in enumerate((None, image(2), None, image(2))):
        sched.add(Sequence(i, Request(prompt=(1,), max_tokens=2, image=img)))
    sched._admit()
    seqs = sched.seqs
    # The oldest admitted sequence's kind, and every admitted one of that kind.
    kind, chosen = choose_step(seqs.values(), CAP, None)
    assert (kind, [s.seq_id for s in chosen]) == (StepKind.PREFILL, [0, 2])
    kind, chosen = choose_step([seqs[i] for i in (1, 2, 3)], CAP, None)
    assert (kind, [s.seq_id for s in chosen]) == (StepKind.IMAGE_PREFILL, [1, 3])
    # Decodes alternate with prefills of either kind.
    seqs[0].phase, seqs[0].launched = Phase.RUNNING, 1
    assert choose_step(seqs.values(), CAP, StepKind.IMAGE_PREFILL)[0] is StepKind.DECODE
    assert choose_step(seqs.values(), CAP, StepKind.DECODE)[0] is StepKind.IMAGE_PREFILL


def test_the_prefill_budget_counts_the_image_prefix():
    sched = Scheduler(CAP)  # max_prefill_tokens=8
    for i in range(3):
        sched.add(Sequence(i, Request(prompt=(1,), max_tokens=1, image=image(2))))
    slot, plan = sched.plan_launch()
    assert [r.seq_id for r in plan.rows] == [0, 1]  # 3 + 3 fits, a third 3 does not
    check_plan(plan, CAP, 32)


# ------------------------------------------------------------- validation
def engine(**kw) -> Engine:
    return Engine(FakeBackend(**dict(dict(num_pages=8, page_size=2, max_prefill_tokens=6, max_context=10,
                                          num_adapter_slots=0), **kw)))


@pytest.mark.parametrize("backend_kw, image_value, message", [
    ({}, "pixels", "image: must be an ImageRef or None, got str"),
    ({"images": False}, image(2), "image: this backend takes no images"),
    ({}, image(0), "image: length must be an int >= 1, got 0"),
    ({}, image(True), "image: length must be an int >= 1, got True"),
    ({}, image(5), "prompt: 7 tokens with the image's 5, more than the 6 one prefill takes"),
    ({}, image(4), r"max_tokens: image \(4\) \+ prompt \(2\) \+ max_tokens \(5\) exceeds the context \(10\)"),
    ({"num_pages": 3}, image(2), "max_tokens: needs 4 KV pages, the cache has 3"),
])
def test_a_refused_image_request_names_its_field(backend_kw, image_value, message):
    e = engine(**backend_kw)
    with pytest.raises(InvalidRequest, match=f"^{message}$"):
        e.submit(Request(prompt=(1, 2), max_tokens=5, image=image_value))
    assert not e.handles and not e.trace


def test_the_largest_image_request_is_accepted():
    e = engine()
    e.submit(Request(prompt=(1, 2), max_tokens=4, image=image(4)))  # 6 prefill tokens; 4 + 2 + 4 == context
    e.run_until_idle()


# ---------------------------------------------------------- value_kind() guards
def run_with(state, **backend_kw):
    """A value-asking request beside a plain one: what each ended as."""
    e = Engine(FakeBackend(zero_cost=True, **backend_kw))
    asking = e.submit(Request(prompt=(0, 3), max_tokens=3, decode_state=lambda: state, skill="pointer"))
    plain = e.submit(Request(prompt=(0, 4), max_tokens=3))
    e.run_until_idle()
    assert plain.result.status is Status.COMPLETED  # a skill's bug fails its own request only
    return asking.result


@pytest.mark.parametrize("state, why", [
    (Asks(boom=True), "skill 'pointer' raised RuntimeError in value_kind: no head here"),
    (Asks(kind="coord"), "skill 'pointer': value_kind() returned 'coord', not a ValueKind or None"),
])
def test_a_bad_value_kind_fails_its_own_request_naming_the_skill(state, why):
    result = run_with(state)
    assert (result.status, result.finish_reason, result.tokens) == (Status.FAILED, why, ())


def test_a_value_asked_of_a_backend_without_a_region_head_fails_its_own_request():
    result = run_with(Asks(), values=False)
    assert result.status is Status.FAILED
    assert result.finish_reason == "skill 'pointer': asked a coord value; this backend decodes no values"


def test_a_state_without_value_kind_asks_none_and_the_plan_stays_empty():
    sched = Scheduler(CAP)
    sched.add(Sequence(0, Request(prompt=(0, 3), max_tokens=2, decode_state=lambda: Asks(kind=None, kinds=(None,)))))
    sched.add(Sequence(1, Request(prompt=(0, 3), max_tokens=2, decode_state=Recorder)))
    sched.launched(*sched.plan_launch())
    step, sample = sched.plan_finalize()
    assert sample.values == () and step.value_kinds == ()


@attrs.define(eq=False)
class Recorder:
    """A skill from before values: no ``value_kind`` at all."""

    def mask_id(self):
        return None

    def advance(self, token, value):
        assert value is None
        return False


def test_values_reach_the_skill_and_match_the_reference_in_both_modes():
    model = FakeModel()
    kinds = (ValueKind.SIZE, None, ValueKind.COORD)
    want = model.expect((0, 3), 6, image=image(2, 11), state=Asks(kinds))
    for pipelined in (True, False):
        e = Engine(FakeBackend(zero_cost=True, model=model), pipelined=pipelined)
        state = Asks(kinds)
        e.submit(Request(prompt=(0, 3), max_tokens=6, stop_ids={0}, image=image(2, 11), decode_state=lambda: state))
        e.run_until_idle()
        assert state.got == list(zip(want.tokens, want.values))
    assert [bad_value(k, v) for k, (_, v) in zip(kinds * 2, state.got)] == [None] * 6


# -------------------------------------------------------------------- I13
@pytest.mark.parametrize("kind,value", [
    (ValueKind.COORD, 0), (ValueKind.COORD, 0.0), (ValueKind.COORD, 1), (ValueKind.COORD, 1.0),
    (ValueKind.SIZE, (1.0, 1.0)), (ValueKind.SIZE, (1e-9, 1)), (None, None),
])
def test_a_value_at_its_kind_s_edge_is_taken(kind, value):
    assert bad_value(kind, value) is None


@pytest.mark.parametrize("kind,value,why", [
    (ValueKind.COORD, -1e-9, "coord value -1e-09 is not a number in [0, 1]"),
    (ValueKind.COORD, 1.0000001, "coord value 1.0000001 is not a number in [0, 1]"),
    (ValueKind.COORD, False, "coord value False is not a number in [0, 1]"),
    (ValueKind.COORD, "0.5", "coord value '0.5' is not a number in [0, 1]"),
    (ValueKind.SIZE, (0.0, 0.5), "size value (0.0, 0.5) is not a (width, height) pair in (0, 1]"),
    (ValueKind.SIZE, (0.5, 0.0), "size value (0.5, 0.0) is not a (width, height) pair in (0, 1]"),
    (ValueKind.SIZE, (0.5, 1.5), "size value (0.5, 1.5) is not a (width, height) pair in (0, 1]"),
    (ValueKind.SIZE, (True, 0.5), "size value (True, 0.5) is not a (width, height) pair in (0, 1]"),
    (ValueKind.SIZE, (0.5, float("nan")), "size value (0.5, nan) is not a (width, height) pair in (0, 1]"),
    (None, 0.5, "a value 0.5 for a row that asked none"),
])
def test_a_value_off_its_kind_is_named_in_full(kind, value, why):
    assert bad_value(kind, value) == why


def launched_and_finalized(kinds):
    """A scheduler with one step launched and finalized for a sequence whose
    skill asks ``kinds`` (one per step)."""
    sched = Scheduler(CAP)
    sched.add(Sequence(0, Request(prompt=(1, 2), max_tokens=4, decode_state=lambda: Asks(kinds))))
    slot, plan = sched.plan_launch()
    sched.launched(slot, plan)
    step, sample = sched.plan_finalize()
    sched.finalized(step)
    return sched, step, sample


@pytest.mark.parametrize("kinds, values, why", [
    ((None,), (0.5,), "a value 0.5 for a row that asked none"),
    ((ValueKind.COORD,), None, "coord value None is not a number in"),
    ((ValueKind.COORD,), (None,), "coord value None is not a number in"),
    ((ValueKind.COORD,), (1.5,), "coord value 1.5 is not a number in"),
    ((ValueKind.COORD,), (float("nan"),), "coord value nan"),
    ((ValueKind.COORD,), (True,), "coord value True"),
    ((ValueKind.COORD,), ((0.1, 0.2),), "coord value"),
    ((ValueKind.SIZE,), (0.5,), "size value 0.5 is not a .width, height. pair"),
    ((ValueKind.SIZE,), ((0.0, 0.5),), "size value"),
    ((ValueKind.SIZE,), ([0.5, 0.5],), "size value"),
    ((ValueKind.SIZE,), ((0.5, 0.5, 0.5),), "size value"),
    ((ValueKind.COORD,), (0.5, 0.5), "I13: step 0 returned 2 values for 1 rows"),
])
def test_a_value_of_the_wrong_shape_is_refused_at_commit_and_changes_nothing_I13(kinds, values, why):
    sched, step, sample = launched_and_finalized(kinds)
    assert sample.values == (kinds if kinds != (None,) else ())
    seq = sched.seqs[0]
    with pytest.raises(InvariantViolation, match=f"I13: .*{why}|{why}"):
        sched.commit(step, StepOutput(step.step_id, (3,), values), None)
    assert list(sched.inflight) == [step] and seq.inflight_refs == 1 and seq.tokens == []


@pytest.mark.parametrize("kinds, values", [
    ((None,), None), ((None,), (None,)), ((ValueKind.COORD,), (0.0,)), ((ValueKind.COORD,), (1,)),
    ((ValueKind.SIZE,), ((2 ** -10, 1.0),)),
])
def test_a_value_of_its_kind_is_committed_and_handed_to_the_skill_I13(kinds, values):
    sched, step, sample = launched_and_finalized(kinds)
    sched.commit(step, StepOutput(step.step_id, (3,), values), None)
    assert sched.seqs[0].state.got == [(3, None if values is None else values[0])]


# ------------------------------------------------------- contract checks
def test_check_sample_refuses_kinds_unless_the_backend_has_a_region_head():
    plan = StepPlan(0, StepKind.PREFILL, (StepRow(0, 0, (1,), 0, (0,)),))
    check_sample(SamplePlan(0, (None,), (ValueKind.COORD,)), plan, (), values=True)
    check_sample(SamplePlan(0, (None,), (None,)), plan, ())
    with pytest.raises(PlanRejected, match="a coord value asked of a backend without a region head"):
        check_sample(SamplePlan(0, (None,), (ValueKind.COORD,)), plan, ())
    with pytest.raises(PlanRejected, match="values must be"):
        check_sample(SamplePlan(0, (None,), [ValueKind.COORD]), plan, (), values=True)


def test_check_plan_fast_path_and_named_checks_agree_on_image_plans():
    # A valid image plan passes the one-pass check; an invalid one is named
    # by the row-by-row checks (never "refused by the contract's checks").
    row = StepRow(0, 0, (1, 2), 0, (0, 1, 2), image=image(3))
    check_plan(StepPlan(0, StepKind.IMAGE_PREFILL, (row,)), CAP, 32)
    for bad in (attrs.evolve(row, image=image(0)), attrs.evolve(row, tokens=()),
                attrs.evolve(row, image=image(5)), attrs.evolve(row, image=None)):
        with pytest.raises(PlanRejected) as err:
            check_plan(StepPlan(0, StepKind.IMAGE_PREFILL, (bad,)), CAP, 32)
        assert "refused by the contract's checks" not in str(err.value)
    with pytest.raises(PlanRejected, match="without images"):
        check_plan(StepPlan(0, StepKind.IMAGE_PREFILL, (row,)), attrs.evolve(CAP, images=False), 32)


# ------------------------------------------------------------- prompt values
REFS = (PromptValue(1, ValueKind.COORD, 0.25), PromptValue(2, ValueKind.COORD, 0.75),
        PromptValue(3, ValueKind.SIZE, (0.5, 0.125)))


def test_prompt_values_are_the_inputs_at_their_positions_in_both_modes():
    """A spatial reference's positions read the value's encoding, not the
    placeholder token: the answer differs from the same prompt without them,
    and equals the reference computed with them, pipelined or not."""
    model = FakeModel()
    prompt = (0, 9, 9, 9, 3)  # 9 is the placeholder the values replace
    want = model.expect(prompt, 5, image=image(2, 11), prompt_values=REFS)
    plain = model.expect(prompt, 5, image=image(2, 11))
    assert want.tokens != plain.tokens
    for pipelined in (True, False):
        e = Engine(FakeBackend(zero_cost=True, model=model, max_prefill_tokens=8), pipelined=pipelined)
        h = e.submit(Request(prompt=prompt, max_tokens=5, stop_ids={0}, image=image(2, 11), prompt_values=REFS))
        e.submit(Request(prompt=prompt, max_tokens=5, stop_ids={0}, image=image(2, 11)))
        e.run_until_idle()
        assert h.result.tokens == want.tokens[:len(h.result.tokens)]
        assert h.result.tokens == model.generate(prompt, 5, stop_ids={0}, image=image(2, 11), prompt_values=REFS)


def test_a_text_prefill_row_carries_its_prompt_values():
    sched = Scheduler(CAP)
    sched.add(Sequence(0, Request(prompt=(1, 2, 3), max_tokens=2, prompt_values=REFS[:1])))
    _, plan = sched.plan_launch()
    assert plan.kind is StepKind.PREFILL and plan.rows[0].prompt_values == REFS[:1]


@pytest.mark.parametrize("backend_kw, values, message", [
    ({"values": False}, REFS[:1], "this backend has no region head to encode values"),
    ({}, ((1, ValueKind.COORD, 0.5),), "entry 0 must be a PromptValue, got tuple"),
    ({}, (PromptValue(4, ValueKind.COORD, 0.5),), r"entry 0: index 4 must be an int in \[0, 4\)"),
    ({}, (PromptValue(-1, ValueKind.COORD, 0.5),), r"entry 0: index -1 must be an int in \[0, 4\)"),
    ({}, (PromptValue(True, ValueKind.COORD, 0.5),), "entry 0: index True must be an int"),
    ({}, (PromptValue(1.0, ValueKind.COORD, 0.5),), "entry 0: index 1.0 must be an int"),
    ({}, REFS[1:2] + REFS[:1], "entry 1: index 1 must be an int .* after the previous entry's"),
    ({}, REFS[:1] * 2, "entry 1: index 1 must be an int"),
    ({}, (PromptValue(0, "coord", 0.5),), "entry 0: kind must be a ValueKind, got 'coord'"),
    ({}, (PromptValue(0, ValueKind.COORD, 1.5),), "entry 0: coord value 1.5 is not a number in"),
    ({}, (PromptValue(0, ValueKind.COORD, float("nan")),), "entry 0: coord value nan"),
    ({}, (PromptValue(0, ValueKind.COORD, "0.5"),), "entry 0: coord value '0.5'"),
    ({}, (PromptValue(0, ValueKind.SIZE, (0.0, 0.5)),), r"entry 0: size value \(0.0, 0.5\) is not"),
    ({}, (PromptValue(0, ValueKind.SIZE, 0.5),), "entry 0: size value 0.5 is not"),
    ({}, REFS[:1] + (PromptValue(3, ValueKind.SIZE, [0.5, 0.5]),), r"entry 1: size value \[0.5, 0.5\]"),
])
def test_refused_prompt_values_name_the_field_and_the_engine_keeps_serving(backend_kw, values, message):
    e = engine(**backend_kw)
    with pytest.raises(InvalidRequest, match=f"^prompt_values: {message}"):
        e.submit(Request(prompt=(1, 2, 3, 4), max_tokens=2, prompt_values=values))
    assert not e.handles and not e.trace
    fine = (PromptValue(0, ValueKind.COORD, 0.0),) if backend_kw.get("values", True) else ()
    h = e.submit(Request(prompt=(1, 2, 3, 4), max_tokens=2, prompt_values=fine))
    e.run_until_idle()
    assert h.result.status is Status.COMPLETED
