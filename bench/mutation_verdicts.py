"""Why each surviving mutant of ``core/`` survives.

Keyed by (``file: function``, the mutated line as mutmut writes it), so a
verdict outlives mutmut renumbering its mutants. Only equivalent mutants
belong here: a mutant that changes behaviour is a gap, closed with a test
(test_core_guards.py, test_engine_api.py and test_engine_pipeline.py hold
the tests written that way).
"""

_SAME_TICK = ("equivalent: every step launched in a tick is finalized in the same tick (both modes), "
              "so `tick()` already reports progress from the other phase; the return value is never "
              "the only progress")

VERDICTS: dict[tuple[str, str], str] = {
    ("core/engine.py: Engine._launch", "return False"): _SAME_TICK,
    ("core/engine.py: Engine._finalize", "return False"): _SAME_TICK,
    ("core/engine.py: Engine._finished", "raise AssertionError(None)"):
        "equivalent: the I7 guard is unreachable through the engine, since `handles.pop` above it "
        "raises `KeyError` on a second answer first; only its message changed",
    ("core/scheduler.py: Scheduler._admit", "self._waited.discard(None)"):
        "equivalent: `_end` forgets the wait again when the request ends, and nothing reads `_waited` "
        "for an admitted request (it is consulted only while the request is refused at the head of "
        "the queue); the id only lingers in memory for the request's life",
}
