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
