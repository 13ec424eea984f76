"""Skills through the real engine on the simulated GPU.

Pipelined and blocking engines must give every request the same tokens,
reason and output (I8), the engine checks every committed token against its
mask (I9), and both must equal the engine-free reference (``drive``) with
the same model, cancels and budget cuts included.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from bubblefree.core import Engine, SamplingParams, Status, ValueKind
from bubblefree.fake_backend import FakeBackend, FakeModel, stable_hash
from bubblefree.fake_backend.images import value_marker
from bubblefree.skills import Kind, LocationCodec, RegionHeadCodec, SkillSet, demo_tokenizer
from bubblefree.skills.codec import box_from_centre
from bubblefree.skills.driver import MaskRecorder, drive

TOK = demo_tokenizer(coord_bins=64, size_bins=16)
CODEC = LocationCodec.for_tokenizer(TOK, coord_bins=64, size_bins=16)
EOS = TOK.eos_id

CALLS = {
    "query": {"question": "what is the cat on"},
    "caption": {"length": "short"},
    "point": {"object": "cat", "max_objects": 3},
    "detect": {"object": "dog", "max_objects": 2},
    "segment": {"object": "cat"},
    "yesno": {"question": "is there a dog"},
}


def model(seed: int, eos_every: int, value_fn=None) -> FakeModel:
    """Scores a pure function of (prompt, position, previous token). EOS wins
    wherever allowed on one position in ``eos_every``, so lists end at
    varied lengths; elsewhere hash noise picks among the allowed tokens."""
    def scores(prompt, position, prev):
        base = stable_hash(seed, len(prompt), prompt[-1], position, prev)
        out = [(stable_hash(base, v) >> 11) / (1 << 53) for v in range(len(TOK))]
        out[EOS] = 2.0 if stable_hash(seed, position) % eos_every == 0 else -1.0
        return out
    return FakeModel(vocab_size=len(TOK), eos_id=EOS, score_fn=scores, value_fn=value_fn)


def run_engine(fake, calls, *, pipelined, codec=CODEC, cancels=None):
    """Submit ``calls`` (name, args, max_tokens, sampling); cancel request i
    once it holds ``cancels[i]`` tokens. Returns (status, tokens, reason, output)."""
    cancels = cancels or {}
    engine = Engine(FakeBackend(model=fake, num_pages=256, max_rows=4), pipelined=pipelined)
    skills = SkillSet(TOK, engine.register_mask, codec=codec)
    handles = [engine.submit(skills.request(name, max_tokens=n, sampling=samp, **args))
               for name, args, n, samp in calls]
    for i, at in cancels.items():
        if at == 0:
            handles[i].cancel()  # before it ever runs
    while engine.tick():
        for i, at in cancels.items():
            h = handles[i]
            if h.result is None and len(h.tokens) >= at:
                assert h.cancel()
    engine.check_integrity()
    return [(h.result.status, h.result.tokens, h.result.finish_reason, h.result.output)
            for h in handles]


def reference(fake, calls, codec=CODEC, cancels=None):
    """The engine-free expectation: the fake model's own pick under each mask."""
    cancels = cancels or {}
    masks = MaskRecorder()
    skills = SkillSet(TOK, masks.register, codec=codec)
    out = []
    for i, (name, args, n, samp) in enumerate(calls):
        req = skills.request(name, max_tokens=n, sampling=samp, **args)
        inputs: list[int] = []  # each step's next decode input
        last: list = []

        def pick(allowed, step, req=req, inputs=inputs, last=last):
            prev = inputs[-1] if inputs else req.prompt[-1]
            position = len(req.prompt) + step
            token = fake.pick(req.prompt, position, prev, req.sampling, allowed)
            inputs.append(token)
            last[:] = [position, prev, token]
            return token, None

        def value(kind, step, req=req, inputs=inputs, last=last):
            # Decoded from the context the token was sampled in; the next
            # input is then the value's marker, not the token.
            v = fake.value(req.prompt, *last, kind, req.sampling)
            inputs[-1] = value_marker(kind, v)
            return v

        tokens, output = drive(req, masks, pick, stop_after=cancels.get(i), values=value)
        out.append((tokens, output))
    return out


call = st.tuples(st.sampled_from(sorted(CALLS)), st.integers(1, 30),
                 st.sampled_from([SamplingParams(), SamplingParams(temperature=0.8, seed=3)]))


@settings(deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 12), st.lists(call, min_size=1, max_size=6),
       st.data())
def test_pipelined_and_blocking_agree_and_match_the_reference(seed, eos_every, drawn, data):
    calls = [(name, CALLS[name], n, samp) for name, n, samp in drawn]
    cancels = data.draw(st.dictionaries(st.integers(0, len(calls) - 1), st.integers(0, 8),
                                        max_size=2), label="cancels")
    fake = model(seed, eos_every)
    piped = run_engine(fake, calls, pipelined=True, cancels=cancels)
    blocking = run_engine(fake, calls, pipelined=False, cancels=cancels)
    assert piped == blocking  # I8
    for (status, tokens, reason, output), (ref_tokens, ref_output) in zip(
            piped, reference(fake, calls, cancels=cancels)):
        if status is Status.CANCELLED:
            assert tokens == ref_tokens[:len(tokens)]
        else:
            assert status is Status.COMPLETED and reason in ("stop", "done", "length")
            assert (tokens, output) == (ref_tokens, ref_output)


def test_all_skills_end_to_end():
    fake = model(seed=11, eos_every=5)
    calls = [(name, args, 24, SamplingParams()) for name, args in CALLS.items()]
    results = run_engine(fake, calls, pipelined=True)
    assert results == run_engine(fake, calls, pipelined=False)
    by_name = {name: r for (name, *_), r in zip(calls, results)}
    assert isinstance(by_name["query"][3]["answer"], str)
    assert isinstance(by_name["caption"][3]["caption"], str)
    assert by_name["yesno"][3]["answer"] in (True, False)
    assert by_name["yesno"][2] == "done"
    for p in by_name["point"][3]["points"]:
        assert 0 <= p["x"] <= 1 and 0 <= p["y"] <= 1
    for b in by_name["detect"][3]["objects"]:
        assert b["x_min"] <= b["x_max"] and b["y_min"] <= b["y_max"]
    seg = by_name["segment"][3]
    assert seg["bbox"] is None or seg["path"] == "" or seg["path"].startswith("M")


def test_budget_cuts_end_on_whole_objects():
    fake = model(seed=5, eos_every=10**9)  # EOS never wins: only budgets end lists
    calls = [("detect", {"object": "cat", "max_objects": 50}, n, SamplingParams())
             for n in range(1, 12)]
    for (status, tokens, reason, output), (_, _, n, _) in zip(
            run_engine(fake, calls, pipelined=True), calls):
        assert len(output["objects"]) == n // 4
        if n < 4:  # no box fits: the state allows only EOS
            assert tokens == (EOS,) and reason == "stop"
        else:  # ended by the state once no further box fits, never mid-box
            assert len(tokens) == 4 * (n // 4) and reason == "done"


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_region_head_model_delivers_values_through_the_engine(pipelined):
    """moondream's cycle: x's step is unconstrained (any token but EOS means
    "x follows"), y's and the size's tokens are not read; each step's value
    is the model's, a (width, height) pair at the size step."""
    codec = RegionHeadCodec.for_tokenizer(TOK)

    def value_fn(prompt, position, token, kind):
        if kind is ValueKind.SIZE:
            return ((position % 5 + 1) / 5, (position % 3 + 1) / 3)
        return (position % 7) / 6

    fake = model(seed=2, eos_every=10**9, value_fn=value_fn)
    calls = [("point", {"object": "cat", "max_objects": 2}, 8, SamplingParams()),
             ("detect", {"object": "dog", "max_objects": 2}, 9, SamplingParams())]
    (_, point_tokens, reason, points), (_, box_tokens, box_reason, boxes) = run_engine(
        fake, calls, pipelined=pipelined, codec=codec)
    assert len(point_tokens) == 4 and reason == "done"
    assert len(box_tokens) == 6 and box_reason == "done"
    assert EOS not in point_tokens + box_tokens
    p = len(TOK.encode("Point: cat"))
    want = [((p + i) % 7) / 6 for i in range(4)]
    assert points == {"points": [{"x": want[0], "y": want[1]}, {"x": want[2], "y": want[3]}]}
    d = len(TOK.encode("Detect: dog"))
    for k, box in enumerate(boxes["objects"]):
        at = d + 3 * k
        cx, cy = (at % 7) / 6, ((at + 1) % 7) / 6
        w, h = ((at + 2) % 5 + 1) / 5, ((at + 2) % 3 + 1) / 3
        assert box == box_from_centre(cx, cy, w, h)
    assert len(boxes["objects"]) == 2
    ref = reference(fake, calls, codec=codec)
    assert ref == [(point_tokens, points), (box_tokens, boxes)]


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_region_head_list_ends_where_the_model_says_eos(pipelined):
    """EOS wherever the model puts it first at an x step ends the list; the
    engine and the engine-free reference agree, default values included."""
    codec = RegionHeadCodec.for_tokenizer(TOK)
    endings = set()
    for seed in range(6):
        fake = model(seed=seed, eos_every=3)
        sampling = SamplingParams(temperature=0.8, seed=seed) if seed % 2 else SamplingParams()
        calls = [("point", {"object": "cat", "max_objects": 5}, 30, sampling),
                 ("detect", {"object": "dog", "max_objects": 5}, 30, sampling)]
        results = run_engine(fake, calls, pipelined=pipelined, codec=codec)
        assert [(tokens, output) for _, tokens, _, output in results] == reference(fake, calls, codec=codec)
        for (status, tokens, reason, output), (name, per) in zip(results, (("point", 2), ("detect", 3))):
            found = output.get("points", output.get("objects"))
            assert status is Status.COMPLETED
            assert (reason, len(tokens)) in (("stop", per * len(found) + 1), ("done", per * len(found)))
            endings.add((name, reason, len(found) > 0))
    # Lists ended by EOS (empty ones too) and by max_objects, for both skills.
    assert endings >= {(n, r, True) for n in ("point", "detect") for r in ("stop", "done")}
    assert {("point", "stop", False), ("detect", "stop", False)} <= endings