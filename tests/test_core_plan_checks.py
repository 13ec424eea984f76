"""``check_plan`` on its own, in microseconds: every refusal's whole
message, and the one-pass fast path (``_plan_ok``) agreeing with the named
checks on each plan. The contract suite (``test_backend_contract.py``) runs
the same refusals through every backend; this file pins the words and the
fast path without building one, so a change to either fails at once.
"""

from __future__ import annotations

import attrs
import pytest

from bubblefree.core import Capacity, ImageRef, PromptValue, StepKind, StepPlan, StepRow, ValueKind
from bubblefree.core.protocol import PlanRejected, ProtocolMisuse, _plan_ok, check_plan

CAP = Capacity(page_size=4, num_pages=32, max_rows=4, max_seqs=8, max_prefill_tokens=24, max_context=48,
               num_adapter_slots=1, images=True, values=True)
VOCAB = 128


def row(seq, tokens=(1, 2, 3), pages=None, row_slot=None, position=0, **kw):
    pages = (2 * seq, 2 * seq + 1) if pages is None else pages
    return StepRow(seq_id=seq, row_slot=seq if row_slot is None else row_slot, tokens=tuple(tokens),
                   position=position, pages=tuple(pages), **kw)


def plan(kind, *rows):
    return StepPlan(step_id=7, kind=kind, rows=tuple(rows))


P, D, I = StepKind.PREFILL, StepKind.DECODE, StepKind.IMAGE_PREFILL
COORD = PromptValue(0, ValueKind.COORD, 0.5)
GOOD = {
    "prefill": plan(P, row(0), row(1)),
    "decode": plan(D, row(0, (), position=3), row(1, (), position=7)),
    "image prefill": plan(I, row(0, (1, 2), image=ImageRef(3, source=1))),
    "at the capacity": plan(P, row(0, (1,) * 12, pages=(0, 1, 2)), row(1, (1,) * 12, pages=(3, 4, 5))),
    "adapter slot": plan(P, row(0, adapter_slot=0)),
    "prompt values": plan(P, row(0, prompt_values=(COORD, PromptValue(2, ValueKind.SIZE, (0.5, 1.0))))),
    "last position": plan(D, row(0, (), pages=tuple(range(12)), position=47)),
    "token ids at both ends": plan(P, row(0, (0, VOCAB - 1))),
}
# name: (plan, capacity changes, the whole message after "step 7: ")
BAD = {
    "no rows": (plan(P), {}, "a step with no rows"),
    "too many rows": (plan(P, *(row(i, pages=(i,)) for i in range(5))), {}, "5 rows, the backend takes 1..4"),
    "image step without images": (plan(I, row(0, image=ImageRef(3))), {"images": False},
                                  "an image_prefill step on a backend without images"),
    "image row without an image": (plan(I, row(0)), {},
                                   "row of seq 0: an image_prefill row needs an ImageRef with an int length > 0, "
                                   "got None"),
    "image length a bool": (plan(I, row(0, image=ImageRef(True, source=1))), {},
                            "row of seq 0: an image_prefill row needs an ImageRef with an int length > 0, "
                            "got ImageRef(length=True, source=1)"),
    "text row with an image": (plan(P, row(0, image=ImageRef(3, source=1))), {},
                               "row of seq 0: a prefill row carries no image"),
    "prefill budget": (plan(P, *(row(i, (1,) * 9, pages=(3 * i, 3 * i + 1, 3 * i + 2)) for i in range(3))), {},
                       "27 prefill tokens, more than max_prefill_tokens=24"),
    "image prefix in the budget": (plan(I, row(0, (1,) * 5, pages=tuple(range(7)), image=ImageRef(20))), {},
                                   "25 prefill tokens, more than max_prefill_tokens=24"),
    "seq twice": (plan(P, row(0), row(0, pages=(4, 5), row_slot=3)), {}, "seq 0 appears twice"),
    "row slot out of range": (plan(P, row(0, row_slot=8)), {}, "row of seq 0: row_slot 8 out of range [0, 8)"),
    "negative row slot": (plan(P, row(0, row_slot=-1)), {}, "row of seq 0: row_slot -1 out of range [0, 8)"),
    "row slot shared": (plan(P, row(0, row_slot=5), row(1, row_slot=5)), {},
                        "row of seq 1: row_slot 5 shared by two rows"),
    "prefill row without tokens": (plan(P, row(0, ())), {}, "row of seq 0: a prefill row needs its prompt tokens"),
    "decode row with tokens": (plan(D, row(0, (1,), position=3)), {},
                               "row of seq 0: a decode row's input is read on the device; tokens must be ()"),
    "token past the vocabulary": (plan(P, row(0, (1, 128))), {},
                                  "row of seq 0: token ids must be in the vocabulary [0, 128)"),
    "negative token": (plan(P, row(0, (-1, 2))), {}, "row of seq 0: token ids must be in the vocabulary [0, 128)"),
    "past the context": (plan(P, row(0, (1,) * 20, pages=tuple(range(12)), position=30)), {},
                         "row of seq 0: positions 30..49 outside the context of 48"),
    "negative position": (plan(D, row(0, (), position=-1)), {},
                          "row of seq 0: positions -1..-1 outside the context of 48"),
    "page out of range": (plan(P, row(0, pages=(0, 32))), {},
                          "row of seq 0: page ids must be in [0, 32), got (0, 32)"),
    "negative page": (plan(P, row(0, pages=(-1, 1))), {}, "row of seq 0: page ids must be in [0, 32), got (-1, 1)"),
    "page twice in a table": (plan(P, row(0, (1,) * 5, pages=(3, 3))), {},
                              "row of seq 0: a page appears twice in one page table (3, 3)"),
    "write beyond pages": (plan(P, row(0, (1,) * 5, pages=(0,))), {},
                           "row of seq 0: writes position 4, beyond its 1 pages of 4"),
    "adapter slot out of range": (plan(P, row(0, adapter_slot=1)), {},
                                  "row of seq 0: adapter_slot 1 out of range [0, 1)"),
    "negative adapter slot": (plan(P, row(0, adapter_slot=-1)), {},
                              "row of seq 0: adapter_slot -1 out of range [0, 1)"),
    "sampling of the wrong type": (plan(P, row(0, sampling=None)), {},
                                   "row of seq 0: sampling must be SamplingParams"),
    "prompt values without a region head": (plan(P, row(0, prompt_values=(COORD,))), {"values": False},
                                            "row of seq 0: prompt_values: this backend has no region head to "
                                            "encode values"),
    "prompt value past the tokens": (plan(P, row(0, prompt_values=(PromptValue(3, ValueKind.COORD, 0.5),))), {},
                                     "row of seq 0: prompt_values: entry 0: index 3 must be an int in [0, 3), "
                                     "after the previous entry's"),
    "prompt value on a decode row": (plan(D, row(0, (), position=3, prompt_values=(COORD,))), {},
                                     "row of seq 0: prompt_values: entry 0: index 0 must be an int in [0, 0), "
                                     "after the previous entry's"),
    "prompt value of a bad size": (plan(P, row(0, prompt_values=(PromptValue(0, ValueKind.SIZE, (0.5,)),))), {},
                                   "row of seq 0: prompt_values: entry 0: size value (0.5,) is not a (width, "
                                   "height) pair in (0, 1]"),
    # The slow path runs only for a refused plan: a field at its edge must
    # pass there too, so the defect after it is the one named.
    "max_rows rows and a bad token": (plan(P, *(row(i, (1, 2, 3 if i < 3 else 128)) for i in range(4))), {},
                                      "row of seq 3: token ids must be in the vocabulary [0, 128)"),
    "adapter slot 0 and bad sampling": (plan(P, row(0, adapter_slot=0, sampling=None)), {},
                                        "row of seq 0: sampling must be SamplingParams"),
    "pages shared by rows": (plan(P, row(0, pages=(0, 1)), row(1, pages=(1, 2)), row(2, pages=(2, 3))), {},
                             "pages [1, 2] shared with another row"),
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_a_valid_plan_passes_the_fast_path(name):
    assert _plan_ok(GOOD[name], CAP, VOCAB)
    check_plan(GOOD[name], CAP, VOCAB)


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_refusal_names_its_field_in_full(name):
    bad, changes, message = BAD[name]
    cap = attrs.evolve(CAP, **changes)
    assert not _plan_ok(bad, cap, VOCAB)
    with pytest.raises(PlanRejected) as err:
        check_plan(bad, cap, VOCAB)
    assert str(err.value) == f"step 7: {message}"


def test_not_a_plan_and_the_caller_chosen_error_type():
    class Misuse(ProtocolMisuse):
        pass

    for thing in ("prefill", None, attrs.evolve(plan(P, row(0)), kind="prefill")):
        with pytest.raises(PlanRejected, match="^launch takes a StepPlan, got "):
            check_plan(thing, CAP, VOCAB)
    with pytest.raises(Misuse, match="^step 7: a step with no rows$"):
        check_plan(plan(P), CAP, VOCAB, error=Misuse)


def test_a_fast_path_that_disagrees_with_the_named_checks_is_refused_not_run(monkeypatch):
    """A plan the fast path refuses but no named check explains is refused
    (never run): the last line of defence if the two drift apart."""
    import bubblefree.core.protocol as protocol

    monkeypatch.setattr(protocol, "_plan_ok", lambda *a: False)
    with pytest.raises(PlanRejected, match=r"^step 7: refused by the contract's checks$"):
        check_plan(GOOD["prefill"], CAP, VOCAB)
