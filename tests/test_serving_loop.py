"""The serving loop's thread: requests from many threads, and a lost device."""

from __future__ import annotations

import threading

import pytest

from bubblefree.loop import EngineStopped, ServingLoop
from bubblefree.core import Engine, Request, Status
from bubblefree.fake_backend import FakeBackend, FakeModel


def wait_result(loop: ServingLoop, request: Request):
    done = threading.Event()
    handle = loop.submit(request, lambda h, t: done.set() if t is None else None)
    assert done.wait(30)
    return handle.result(0)


def test_threads_submit_concurrently_and_get_the_model_tokens():
    loop = ServingLoop(Engine(FakeBackend(zero_cost=True)))
    prompts = [(k % 5, 3, k) for k in range(1, 13)]
    results: dict[tuple, object] = {}

    def ask(prompt):
        results[prompt] = wait_result(loop, Request(prompt=prompt, max_tokens=6, stop_ids={0}))

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loop.close()
    assert not loop._thread.is_alive()  # close() returns once the decode thread has ended
    for p in prompts:
        assert results[p].tokens == FakeModel().generate(p, 6)


class DeviceLost(FakeBackend):
    """A backend whose device dies at its third step: an error outside the
    protocol's StepFailed, as a real CUDA fault would be."""

    def launch(self, slot, plan):
        if plan.step_id == 2:
            raise RuntimeError("device lost")
        return super().launch(slot, plan)


def test_a_lost_device_fails_every_live_request_and_refuses_new_work():
    loop = ServingLoop(Engine(DeviceLost(zero_cost=True)))
    result = wait_result(loop, Request(prompt=(0, 1), max_tokens=20))
    assert result.status is Status.FAILED  # I7: answered, not left waiting
    assert "RuntimeError: device lost" in result.finish_reason
    with pytest.raises(EngineStopped, match="stopped: RuntimeError: device lost"):
        loop.submit(Request(prompt=(0, 1), max_tokens=2))
    loop.close()


class Held(FakeBackend):
    """A device that holds its second launch until told (``go``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.reached, self.go = threading.Event(), threading.Event()

    def hold(self, plan) -> bool:
        if plan.step_id != 1:
            return False
        self.reached.set()
        assert self.go.wait(30)
        return True

    def launch(self, slot, plan):
        self.hold(plan)
        return super().launch(slot, plan)


class HeldThenLost(Held):
    """Held, then dies instead of launching: work handed to the loop
    meanwhile is still in the inbox when it is lost."""

    def launch(self, slot, plan):
        if self.hold(plan):
            raise RuntimeError("device lost")
        return FakeBackend.launch(self, slot, plan)


def test_work_handed_over_as_the_device_is_lost_is_answered():
    """A submit and a mode switch waiting in the inbox when the device dies:
    the submit ends FAILED with the error as its reason (I7), and the switch
    returns instead of waiting for a drain that never comes."""
    backend = HeldThenLost(zero_cost=True)
    loop = ServingLoop(Engine(backend))
    first = loop.submit(Request(prompt=(0, 1), max_tokens=20))
    assert backend.reached.wait(30)
    late = loop.submit(Request(prompt=(2, 3), max_tokens=5, tag="late"))
    switch = threading.Thread(target=loop.set_pipelined, args=(False,), daemon=True)
    switch.start()
    while len(loop._inbox) < 2:  # both handed over before the device dies
        threading.Event().wait(0.001)
    backend.go.set()
    switch.join(30)
    assert not switch.is_alive()
    assert first.result(30).status is Status.FAILED
    result = late.result(30)
    assert (result.request_id, result.status, result.tokens, result.tag) == (
        late.request_id, Status.FAILED, (), "late")
    assert result.finish_reason == "engine error: RuntimeError: device lost"
    assert not loop._live
    loop.close()


def test_the_core_counts_the_submits_handed_over_and_not_yet_taken():
    """``Engine.arrivals`` (the auto rule's foresight of a prefill) counts
    the requests in the inbox: each submit, not a cancel; none once the
    decode thread has taken them, or once the loop has stopped."""
    backend = Held(zero_cost=True)
    loop = ServingLoop(Engine(backend, pipelined="auto"))
    first = loop.submit(Request(prompt=(0, 1), max_tokens=6))
    assert backend.reached.wait(30)  # the decode thread is inside a tick
    assert loop.core.arrivals() == 0
    loop.submit_all([(Request(prompt=(2, 3), max_tokens=2), None),
                     (Request(prompt=(4, 5), max_tokens=2), None)])
    third = loop.submit(Request(prompt=(6, 7), max_tokens=2))
    third.cancel()
    assert loop.core.arrivals() == 3
    backend.go.set()
    assert first.result(30).status is Status.COMPLETED
    third.result(30)
    assert loop.core.arrivals() == 0
    loop.close()
    assert loop.core.arrivals() == 0


class AbortFails(Engine):
    """A core broken past its own abort: the loop must end the live requests itself."""

    def abort(self, reason):
        raise RuntimeError("abort broke too")


class Ends:
    """A listener that records the end it is told of (an ``arun`` waits on it)."""

    def __init__(self):
        self.ended, self.told = threading.Event(), []

    def __call__(self, handle, token):
        if token is None:
            self.told.append(handle.request_id)
            self.ended.set()


def test_requests_the_broken_core_cannot_end_are_ended_by_the_loop():
    loop = ServingLoop(AbortFails(DeviceLost(zero_cost=True)))
    ends = Ends()
    handle = loop.submit(Request(prompt=(0, 1), max_tokens=20, tag="live"), listener=ends)
    result = handle.result(30)
    assert ends.ended.wait(30) and ends.told == [handle.request_id]  # told once: nothing waits forever
    assert (result.request_id, result.status, result.tag) == (handle.request_id, Status.FAILED, "live")
    assert result.finish_reason == "engine error: RuntimeError: device lost"
    assert result.tokens == handle.tokens
    assert not loop._live
    loop.close()


class Refusing(Engine):
    """A core that refuses at submit what its ``validate`` let through."""

    def submit(self, request, request_id=None):
        if request.tag == "refuse":
            raise ValueError("no room today")
        return super().submit(request, request_id)


def test_a_request_the_core_refuses_after_validation_fails_naming_why():
    """It alone ends, FAILED with the core's reason; the request handed over
    with it, live in the core by then, runs on."""
    loop = ServingLoop(Refusing(FakeBackend(zero_cost=True)))
    ends = Ends()
    kept, refused = loop.submit_all([(Request(prompt=(2, 3), max_tokens=8, stop_ids={0}), None),
                                     (Request(prompt=(0, 1), max_tokens=3, tag="refuse"), ends)])
    result = refused.result(30)
    assert ends.ended.wait(30) and ends.told == [refused.request_id]
    assert (result.status, result.tag, result.tokens) == (Status.FAILED, "refuse", ())
    assert result.finish_reason == "refused: ValueError: no room today"
    assert kept.result(30).tokens == FakeModel().generate((2, 3), 8)
    assert wait_result(loop, Request(prompt=(0, 1), max_tokens=3, stop_ids={0})).tokens == FakeModel().generate((0, 1), 3)
    assert not loop._live
    loop.close()


def test_the_mode_is_switched_on_the_decode_thread_between_ticks():
    loop = ServingLoop(Engine(FakeBackend(zero_cost=True)))
    for mode in (False, "auto", True):
        loop.set_pipelined(mode)  # returns once the decode thread made the switch
        assert loop.core.pipelined is mode
    with pytest.raises(TypeError, match='pipelined must be True, False or "auto", got \'ahead\''):
        loop.set_pipelined("ahead")
    assert loop.core.pipelined is True
    ended = loop.submit(Request(prompt=(0, 1), max_tokens=2))
    ended.result(30)
    assert ended.cancel() is False  # nothing to cancel: the request had already ended
    assert wait_result(loop, Request(prompt=(0, 1), max_tokens=3, stop_ids={0})).tokens == FakeModel().generate((0, 1), 3)
    loop.close()
