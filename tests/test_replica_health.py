"""A replica whose engine has stopped says so to Ray's health check, so
Ray replaces it: without the check it stayed in rotation, and every
request sent to it got a 503."""

from __future__ import annotations

import time

import pytest

from bubblefree import Status
from bubblefree.loop import EngineStopped
from bubblefree.server import ServerSettings
from bubblefree.server.replicas import EngineReplica
from tests.serving_world import GATED, WAIT, Gate, make_engine


def replica(gate: Gate | None = None, **settings: object) -> EngineReplica:
    """The replica's health check alone: its engine, without Ray's context."""
    made = object.__new__(EngineReplica)
    made.engine = make_engine(gate=gate)
    made.settings = ServerSettings(**settings)
    return made


def test_a_replica_is_healthy_while_its_engine_serves_and_not_once_it_is_closed():
    made = replica()
    try:
        assert made.check_health() is None
    finally:
        made.engine.close()
    with pytest.raises(EngineStopped, match="closed"):
        made.check_health()


def test_a_replica_whose_step_hangs_fails_its_health_check_until_the_step_ends():
    """Its thread alive, it passed every check while its requests timed out."""
    gate = Gate()
    made = replica(gate, stall_s=0.2)
    try:
        gate.arm()
        handle = made.engine.submit("query", question=GATED, max_tokens=5)
        gate.wait_reached()
        time.sleep(0.3)
        with pytest.raises(RuntimeError, match="engine: no decode step has ended in"):
            made.check_health()
        gate.open()
        assert handle.result(WAIT).status is Status.COMPLETED
        assert made.check_health() is None
    finally:
        gate.open()
        made.engine.close()
