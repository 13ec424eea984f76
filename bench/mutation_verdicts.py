"""Why each surviving mutant survives.

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
    ("core/engine.py: Engine._finished", "raise AssertionError(None)"):
        "equivalent: the I7 guard is unreachable through the engine, since `handles.pop` above it "
        "raises `KeyError` on a second answer first; only its message changed",
}

_KEY_ONLY = ("equivalent: `Ownership.key` only tells the search which states to merge; the uses it "
             "lists are fixed by the in-flight steps and the device timeline already in the key, so "
             "dropping their step ids merges nothing new, and absolute times or uses ending now only "
             "split states (the floors are minimums)")
_KEY = "return tuple(tuple(sorted((u.id, u.seq_id, {}, u.until {} now) for u in o.uses if u.until {} now))"
VERDICTS.update({
    ("fake_backend/owners.py: Ownership.key", _KEY.format("rel(None)", "-", ">")): _KEY_ONLY,
    ("fake_backend/owners.py: Ownership.key", _KEY.format("rel(u.step_id)", "+", ">")): _KEY_ONLY,
    ("fake_backend/owners.py: Ownership.key", _KEY.format("rel(u.step_id)", "-", ">=")): _KEY_ONLY,
    ("fake_backend/owners.py: Owners.touch",
     "kept = tuple(u for u in self.uses if u.until >= now and not (u.step_id == step_id and u.id in ids))"):
        "equivalent: a use ending exactly at the host's now is kept one touch longer, but `check` "
        "fires only for a use ending after the claim, and a claim is never earlier than now",
})

# Functions the test subset does not reach by design: a mutant of them is
# "no tests" in mutmut's words, a survivor by its score, and reported with
# the reason here instead of as unjudged. Keyed by ``file: function``.
_A_MODEL = ("outside the subset: it builds a model on torch ({}); {} call it, and the subset leaves them "
            "out for their cost")
OUTSIDE: dict[str, str] = {
    "bubblefree/engine.py: Engine.from_pretrained": _A_MODEL.format(
        "a checkpoint, or the embedded GGUF model", "tests/test_api.py and tests/test_load.py"),
    "bubblefree/engine.py: Engine.moondream_random": _A_MODEL.format(
        "a random moondream", "tests/test_moondream_engine.py and tests/test_moondream_load.py"),
}
