"""A replica whose engine has stopped says so to Ray's health check, so
Ray replaces it: without the check it stayed in rotation, and every
request sent to it got a 503."""

from __future__ import annotations

import pytest

from bubblefree.loop import EngineStopped
from bubblefree.server.replicas import EngineReplica
from tests.serving_world import make_engine


def replica() -> EngineReplica:
    """The replica's health check alone: its engine, without Ray's context."""
    made = object.__new__(EngineReplica)
    made.engine = make_engine()
    return made


def test_a_replica_is_healthy_while_its_engine_serves_and_not_once_it_is_closed():
    made = replica()
    try:
        assert made.check_health() is None
    finally:
        made.engine.close()
    with pytest.raises(EngineStopped, match="closed"):
        made.check_health()
