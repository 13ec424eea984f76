"""An engine for the relay's edge tests whose route can fail inside a
replica on cue. The replicas unpickle it: a test registers this module
(and server_support) with Ray's cloudpickle by value."""

from __future__ import annotations

from server_support import fake_engine

BUG = "a bug"  # the question whose route raises inside the replica


def faulty_engine(**options):
    """``fake_engine(**options)`` whose ``submit`` raises ``RuntimeError`` for
    the question ``BUG``: a bug in a route, inside a replica."""
    engine = fake_engine(**options)
    submit = engine.submit

    def faulty(skill, **args):
        if args.get("question") == BUG:
            raise RuntimeError("a bug")
        return submit(skill, **args)

    engine.submit = faulty
    return engine
