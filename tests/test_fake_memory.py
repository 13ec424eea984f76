"""The simulated GPU's own misuse checks, beyond the contract that
test_backend_contract.py runs against both backends: a copy in flight, step
order, decode inputs read on the device, the paged KV, and who owns each
page and slot while the device uses it (I4, I6). Each raises and changes
nothing."""

from __future__ import annotations

import attrs
import pytest

from bubblefree.core.values import ImageRef, StepFailed, StepRow
from bubblefree.fake_backend import FakeBackend, Fault, HardwareMisuse, KVCorruption, Timing
from fake_plans import (
    SlotState, blocking_step, decode, drow, finalize, image_prefill, irow, prefill, prow, to_state,
)


def test_launch_into_a_slot_whose_copy_is_in_flight_names_the_hazard():
    b = FakeBackend(timing=Timing(copy=10.0))
    to_state(b, SlotState.FINALIZED)
    assert b.slots[0].host_buffer is None  # the copy has not landed
    with pytest.raises(HardwareMisuse, match="in flight"):
        b.launch(0, prefill(1, prow(1, (1,), (1,))))


def test_host_buffer_is_written_only_when_the_copy_lands():
    b = FakeBackend(timing=Timing(launch_cost=0.0, finalize_cost=0.0, forward=1.0, sampling=0.5,
                                  copy=4.0, commit_cost_per_row=0.0))
    to_state(b, SlotState.FINALIZED)
    assert b.slots[0].copy_end == pytest.approx(5.5)
    b.launch(1, prefill(1, prow(1, (1,), (1,))))
    assert b.slots[0].host_buffer is None and b.clock.host < 5.5
    out = b.wait(0)
    assert b.clock.host == pytest.approx(5.5) and b.slots[0].host_buffer is out


def test_a_decode_with_nothing_sampled_is_refused_and_changes_nothing():
    b = FakeBackend()
    with pytest.raises(HardwareMisuse, match="no token was ever sampled"):
        b.launch(0, decode(0, drow(0, 3, (0,))))
    assert b.slots[0].state is SlotState.FREE and b.log == [] and b.memory.kv == {}
    blocking_step(b, 0, prefill(0, prow(0, (1,), (0,))))  # still serves


def test_step_ids_must_increase_and_slot_ids_are_0_and_1():
    b = FakeBackend()
    blocking_step(b, 0, prefill(5, prow(0, (1,), (0,))))
    with pytest.raises(HardwareMisuse, match="increase"):
        b.launch(1, prefill(5, prow(1, (1,), (1,))))
    with pytest.raises(HardwareMisuse):
        b.launch(2, prefill(6, prow(1, (1,), (1,))))


def test_decode_input_must_come_from_an_enqueued_sampling():
    # Launching t+1 before finalizing t would read a stale row slot on a GPU.
    b = FakeBackend()
    pages = (0, 1)
    blocking_step(b, 0, prefill(0, prow(0, (0, 4, 4), pages)))
    b.launch(0, decode(1, drow(0, 3, pages)))
    with pytest.raises(HardwareMisuse, match="not enqueued"):
        b.launch(1, decode(2, drow(0, 4, pages)))
    finalize(b, 0, decode(1, drow(0, 3, pages)))
    b.launch(1, decode(2, drow(0, 4, pages)))  # now its input exists


def test_row_slot_handed_to_another_sequence_is_detected():
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 4), (0,), row_slot=3)))
    blocking_step(b, 1, prefill(1, prow(1, (0, 5), (1,), row_slot=3)))
    with pytest.raises(HardwareMisuse, match="another sequence"):
        b.launch(0, decode(2, drow(0, 2, (0,), row_slot=3)))


# ----------------------------------------------------------------------- KV
@pytest.mark.parametrize("thief_pages, where", [
    ((1, 2), "position 4"),  # another sequence's entries at other positions
    ((0, 2), "position 0"),  # another sequence's entries at the very same positions
])
def test_page_reused_while_owned_is_detected_and_changes_nothing(thief_pages, where):
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 1, 2, 3, 4), (0, 1))))
    blocking_step(b, 1, prefill(1, prow(1, (0, 9, 9), thief_pages)))  # a page still seq 0's
    kv = dict(b.memory.kv)
    with pytest.raises(KVCorruption, match=where):
        b.launch(0, decode(2, drow(0, 5, (0, 1))))
    assert b.memory.kv == kv and b.slots[0].state is SlotState.FREE
    blocking_step(b, 0, decode(2, drow(1, 3, thief_pages)))  # seq 1 reads its own KV fine


def test_wrong_page_table_is_detected():
    # Full pages: every position holds seq 0's KV, only at the wrong place.
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 1, 2, 3, 4, 5, 6, 7), (0, 1))))
    with pytest.raises(KVCorruption, match="holds seq 0 position 4"):
        b.launch(1, decode(1, drow(0, 8, (1, 0, 2))))
    blocking_step(b, 1, decode(1, drow(0, 8, (0, 1, 2))))


def test_model_reads_its_prompt_back_from_the_kv():
    # Chunked prefill: the second chunk's tokens depend on the first chunk's KV.
    b = FakeBackend()
    blocking_step(b, 0, prefill(0, prow(0, (0, 5, 6, 7), (0, 1))))
    out = blocking_step(b, 1, prefill(1, StepRow(0, 0, (8, 9), 4, (0, 1))))
    prompt = (0, 5, 6, 7, 8, 9)
    assert out.tokens == (b.model.pick(prompt, 6, 9),)
    # Prompt KV may not follow generated KV: a chunk after a decode is refused.
    blocking_step(b, 0, decode(2, drow(0, 6, (0, 1))))
    with pytest.raises(KVCorruption, match="after generated"):
        b.launch(1, prefill(3, StepRow(0, 0, (1,), 7, (0, 1))))


# ------------------------------------------- ownership on the device's timeline
# The host plans the next step while the last one still runs on the device:
# a page, row slot or adapter slot named for another sequence at that moment
# would be touched by both on a GPU (I6). Default timing: the host plans at
# t=0.15; the forward of step 0 runs until t=1.12 and its sampling until 1.17.

def _in_flight(b, row):
    plan = prefill(0, row)
    b.launch(0, plan)
    finalize(b, 0, plan)
    return plan


def test_a_page_named_while_another_sequences_forward_runs_is_corruption_and_changes_nothing():
    b = FakeBackend()
    _in_flight(b, prow(0, (1, 2), (0,)))
    kv, log = dict(b.memory.kv), list(b.log)
    thief = prefill(1, prow(1, (3,), (1, 0), row_slot=1))
    with pytest.raises(KVCorruption, match=r"^step 1: KV page 0 named for seq 1 at t=0\.15, while seq 0's step 0 "
                                           r"touches it on the device until t=1\.12"):
        b.launch(1, thief)
    assert b.memory.kv == kv and b.log == log and b.slots[1].state is SlotState.FREE
    b.wait(0)
    b.release(0)
    blocking_step(b, 1, thief)  # after the owner's commit the page may go on


def test_a_row_slot_named_while_another_sequences_sampling_runs_is_corruption():
    b = FakeBackend()
    _in_flight(b, prow(0, (1, 2), (0,)))
    with pytest.raises(KVCorruption, match="row slot 0 named for seq 1 .* until t=1\\.17"):
        b.launch(1, prefill(1, prow(1, (3,), (1,), row_slot=0)))


def test_an_adapter_slot_named_while_another_sequences_forward_reads_it_is_corruption():
    b = FakeBackend()
    _in_flight(b, attrs.evolve(prow(0, (1, 2), (0,)), adapter_slot=1))
    with pytest.raises(KVCorruption, match="adapter slot 1 named for seq 1"):
        b.launch(1, prefill(1, attrs.evolve(prow(1, (3,), (1,)), adapter_slot=1)))
    b.launch(1, prefill(1, attrs.evolve(prow(1, (3,), (1,)), adapter_slot=0)))  # another slot is free


def test_every_row_of_a_step_holds_its_pages():
    b = FakeBackend()
    _in_flight(b, prow(0, (1, 2), (0,)))
    b.launch(1, prefill(1, prow(1, (3,), (1,)), prow(2, (4,), (2,))))  # two rows, behind step 0
    b.wait(0)
    b.release(0)
    with pytest.raises(KVCorruption, match="KV page 1 named for seq 3 .* seq 1's step 1"):
        b.launch(0, prefill(2, prow(3, (5,), (1,), row_slot=3)))


def test_the_same_sequence_may_name_its_own_pages_while_its_step_runs():
    b = FakeBackend()
    first = _in_flight(b, prow(0, (1, 2), (0,)))
    b.launch(1, decode(1, drow(0, 2, (0,))))  # the pipelined decode behind its prefill
    assert b.slots[1].state is SlotState.LAUNCHED and first.rows[0].pages == (0,)


def test_a_step_abandoned_at_finalize_holds_nothing():
    b = FakeBackend(faults={0: Fault("finalize", "kernel")})
    plan = prefill(0, prow(0, (1, 2), (0,)))
    b.launch(0, plan)
    with pytest.raises(StepFailed):
        finalize(b, 0, plan)
    b.release(0)
    b.launch(0, prefill(1, prow(1, (3,), (0,), row_slot=0)))  # nothing reads what step 0 wrote


# ------------------------------------------------------------------- images
def test_an_image_prefix_is_written_in_device_time_like_any_write():
    # The prefix's pages are the image row's from the launch that names
    # them until its forward ends: an image prefill cannot take a page
    # another sequence's forward still runs over, nor lose its own early.
    b = FakeBackend()
    _in_flight(b, prow(0, (1, 2), (0,)))
    img = b.image_ref(42)  # 3 prefix positions
    with pytest.raises(KVCorruption, match="KV page 0 named for seq 1 .* while seq 0's step 0"):
        b.launch(1, image_prefill(1, irow(1, img, (3,), (1, 0), row_slot=1)))
    b.launch(1, image_prefill(1, irow(1, img, (3,), (1, 2), row_slot=1)))
    b.wait(0)
    b.release(0)
    with pytest.raises(KVCorruption, match="KV page 2 named for seq 2 .* while seq 1's step 1"):
        b.launch(0, prefill(2, prow(2, (4,), (2,), row_slot=2)))


def test_an_image_prefix_is_read_back_from_the_kv_before_the_prompt():
    b = FakeBackend()
    img = b.image_ref(42)
    plan = image_prefill(0, irow(0, img, (3, 4), (0, 1)))
    blocking_step(b, 0, plan)
    kv = [b.memory.kv[(p // 4, p % 4)] for p in range(5)]
    assert [e.is_prompt for e in kv] == [True] * 5 and [e.token for e in kv][3:] == [3, 4]
    assert all(e.token < 0 for e in kv[:3])  # markers, never a vocabulary id
    b.memory.kv[(0, 1)] = attrs.evolve(kv[1], seq_id=9)  # a page table pointing elsewhere
    with pytest.raises(KVCorruption, match="KV of position 1 .* holds seq 9"):
        b.launch(1, decode(1, drow(0, 5, (0, 1))))


def test_an_image_source_the_fake_cannot_read_is_a_misuse_before_any_write():
    b = FakeBackend()
    with pytest.raises(HardwareMisuse, match="image source: cannot fingerprint .* object"):
        b.launch(0, image_prefill(0, irow(0, ImageRef(2, source=object()), (1,), (0,))))
    assert b.log == [] and b.memory.kv == {} and b.slots[0].state is SlotState.FREE
