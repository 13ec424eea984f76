"""bench.vlm_speed and bench.vlm_profile on the CPU with the tiny random
moondream: the commands run end to end through the public API and write
their section; the figures are not checked (no timing in tests)."""

import collections
import gc
import json
import sys
import types

import pytest

pytest.importorskip("torch")

from bubblefree.bench import vlm_speed  # noqa: E402


def test_vlm_speed_runs_the_image_api_and_writes_its_section(tmp_path):
    out, record = tmp_path / "bench.md", tmp_path / "run.json"
    out.write_text("# Speed benchmarks\n\nearlier text\n")
    text = vlm_speed.main(["--quick", "--no-peer", "--device", "cpu", "--streams", "1", "--sizes", "378",
                           "--workloads", "point,query", "--per-stream", "1", "--out", str(out),
                           "--record", str(record)])
    doc = out.read_text()
    assert "earlier text" in doc and vlm_speed.BEGIN in doc and vlm_speed.END in doc
    assert "| point | 378 px | 1 |" in text and "| query | 378 px | 1 |" in text
    assert "smoke run, not a measurement" in text
    rec = json.loads(record.read_text())
    assert [r["workload"] for r in rec["rows"]] == ["point", "query"]
    assert all("a_req_s" in r for r in rec["rows"])  # the per-tick choice measured beside the two modes
    assert all("error" not in r for r in rec["rows"]), rec["rows"]
    assert rec["encode"][0]["crops"] == 2  # a 378-px image: the global view and one local crop


def test_render_states_each_target_and_the_losing_cells(tmp_path):
    row = dict(workload="point", side=378, streams=1, requests=17, p_req_s=10.0, b_req_s=12.0, ratio=10 / 12,
               p_p50=20.0, p_p99=30.0, b_p50=18.0, b_p99=25.0)
    query = dict(row, workload="query", p_req_s=60.0, b_req_s=50.0, ratio=1.2)
    record = dict(env="somewhere", command="python -m bubblefree.bench.vlm_speed", quick=False,
                  rows=[row, query, dict(workload="detect", side=378, streams=8, error="RuntimeError: x")],
                  encode=[dict(side=378, crops=2, image_ms=3.0, crop_ms=1.5)],
                  peer=[["point", 1, dict(req_s=16.0, p50_ms=62.0)]], peer_crop_ms=2.1)
    text = vlm_speed.render(record, None, None)
    assert "point, fresh 378 px, 1 stream: p50 20.0 ms (target <= 15): not met" in text
    assert "query capped at 10 tokens, 378 px, 1 stream: 60.0 req/s (target >= 50): met" in text
    assert "1.50 ms per crop (target <= 2): met" in text
    assert "pipelined >= blocking: 1 of 2 cells (below: point 378 px x1 0.83)" in text
    assert "| detect | 378 px | 8 | RuntimeError: x |" in text
    assert "| point | 378 px | 1 | 10.0 | 12.0 | 0.83 | 20.0 / 30.0 | 18.0 / 25.0 | 16.0 | 62.0 |" in text
    assert "The peer is a transformers LLaVA" in text and "did not run" not in text


def test_unknown_workloads_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        vlm_speed.main(["--workloads", "point,dance", "--device", "cpu"])
    assert "unknown dance" in capsys.readouterr().err


def _engine(ticks=(0, 0, 0), kept=()):
    """The serving engine as ``vlm_speed.measure`` reads it: the mode it
    sets, auto's tick counters and the rule's records of behind ticks."""
    from bubblefree.core.ahead_measures import Successors, Timings
    core = types.SimpleNamespace(ahead_ticks=ticks[0], behind_ticks=ticks[1], unweighed_ticks=ticks[2],
                                 behind=collections.deque(kept, maxlen=4),
                                 timings=Timings(lambda: 0.0), successors=Successors())
    return types.SimpleNamespace(pipelined=True, core=core)


@pytest.mark.parametrize("turn,first", [(1, [False, "auto", True, True, "auto", False]),
                                        (2, ["auto", True, False, False, True, "auto"]),
                                        (3, [True, False, "auto", "auto", False, True])])
def test_a_cells_turn_turns_the_order_of_its_runs(monkeypatch, turn, first):
    """``measure(turn=...)``: the grid's later cells start the alternation
    with another mode (``speed_report.run_order``), so the mode whose runs
    sit side by side in the middle is not always auto."""
    order = []

    def cell(engine, workload, pictures, streams):
        order.append(engine.pipelined)
        return dict(req_s=1.0, p50_ms=1.0, p99_ms=1.0)
    monkeypatch.setattr(vlm_speed, "run_cell", cell)
    monkeypatch.setattr(vlm_speed, "images", lambda count, side, seed: [])
    vlm_speed.measure(_engine(), "point", 378, 1, 3, seed=0, rounds=2, turn=turn)
    assert order[1:] == first * 2  # after the warm-up run


def test_rounds_repeat_the_alternation_and_each_mode_keeps_its_median(monkeypatch):
    order, rates = [], {True: iter([10, 30, 20, 99]), False: iter([5, 6, 7, 8]), "auto": iter([9, 1, 2, 3])}

    from bubblefree.core.ahead import Behind
    from bubblefree.core.values import StepKind
    # auto's counters, moved only by auto's runs (as the core's), and by earlier cells
    engine = _engine(ticks=(100, 50, 70), kept=[Behind(1, 9.0, 0.0, 0.0, 1.0)] * 3)

    def cell(engine, workload, pictures, streams):
        order.append(engine.pipelined)
        rate = next(rates[engine.pipelined]) if len(order) > 1 else 0  # the first run warms up
        if engine.pipelined == "auto":
            engine.core.ahead_ticks += 2
            engine.core.behind_ticks += 1
            engine.core.unweighed_ticks += 1  # launched ahead unweighed: a tick all the same
            rows = 2 * len(order)  # each behind tick of its own, none of an earlier cell's
            engine.core.behind.append(Behind(rows, 1.0, 0.0002, 0.001 * rows, 0.5))
            # the rule's running means as auto's last run left them
            engine.core.timings.launch_hosts[StepKind.PREFILL] = 0.001 * len(order)
        else:
            engine.core.timings.launch_hosts[StepKind.PREFILL] = 1.0
        return dict(req_s=rate, p50_ms=1.0, p99_ms=2.0)

    monkeypatch.setattr(vlm_speed, "run_cell", cell)
    monkeypatch.setattr(vlm_speed, "images", lambda count, side, seed: [])
    row = vlm_speed.measure(engine, "point", 378, 1, 3, seed=0, rounds=2)
    assert order[1:] == [True, False, "auto", "auto", False, True] * 2
    assert (row["p_req_s"], row["b_req_s"], row["a_req_s"]) == (25, 6.5, 2.5)
    assert row["runs"] == {"p": [10, 30, 20, 99], "b": [5, 6, 7, 8], "a": [9, 1, 2, 3]}  # in the order run
    assert row["a_vs_better"] == 2.5 / 25
    assert row["a_behind"] == 0.25  # this cell's auto runs only: 4 behind of 16 ticks
    why = row["a_behind_why"]  # the four behind ticks of its auto runs (rows 8, 10, 20, 22)
    assert why["ticks"] == 4 and why["rows"] == 15 and why["zombies"] == 1.0 and why["follow"] == 0.5
    assert why["bubble_ms"] == pytest.approx(0.2) and why["forward_ms"] == pytest.approx(15.0)
    assert why["zombie_cost_ms"] == pytest.approx(1.0)  # forward x zombies / rows: 1 ms at any rows
    timed = row["a_timings"]  # auto's last run (the eleventh): its launch call, not the later runs'
    assert timed["launch_ms"] == {StepKind.PREFILL.value: pytest.approx(11.0)}
    assert timed["commit_ms"] is None and timed["forward_ms"] == {} and timed["follow"] == 0.5
    assert vlm_speed.behind_summary([]) is None and vlm_speed.behind_summary(collections.deque()) is None


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        vlm_speed.main(["--rounds", "0", "--device", "cpu"])
    assert "--rounds: must be at least 1" in capsys.readouterr().err


def test_a_run_with_auto_reports_it_against_the_better_mode():
    row = dict(workload="point", side=378, streams=1, requests=17, p_req_s=10.0, b_req_s=12.0, ratio=10 / 12,
               p_p50=20.0, p_p99=30.0, b_p50=18.0, b_p99=25.0, a_req_s=11.0, a_vs_better=11 / 12)
    good = dict(row, workload="detect", a_req_s=12.0, a_vs_better=1.0, a_behind=0.125)
    record = dict(env="somewhere", command="c", quick=False, rows=[row, good], encode=[], peer=[],
                  peer_crop_ms=None)
    text = vlm_speed.render(record, None, None)
    assert "| auto req/s | auto ÷ better |" in text
    assert "| point | 378 px | 1 | 10.0 | 12.0 | 0.83 | 11.0 | 0.92 | 20.0 / 30.0 | 18.0 / 25.0 | — |  |" in text
    assert "| 12.0 | 1.00 (behind at 12% of ticks) |" in text  # records before the count have none
    assert "auto (the per-tick choice) >= 0.98 x the better of pipelined and blocking: 1 of 2 cells " \
           "(below: point 378 px x1 0.917)" in text
    assert "The peer did not run in this call." in text and "The peer is a" not in text


def test_vlm_timeline_splits_each_window_by_call_and_nests_without_double_counting():
    from bubblefree.bench import vlm_timeline
    spans = [("tick", 0.0, 10.0), ("launch decode", 1.0, 3.0), ("wait decode", 4.0, 12.0),
             ("submit", -5.0, -1.0)]
    parts = vlm_timeline.within(spans, 2.0, 8.0)  # clipped to the window, outside ones dropped
    assert parts == {"tick": 6.0, "launch decode": 1.0, "wait decode": 4.0}


def test_vlm_timeline_hand_offs_run_from_submit_to_take_and_from_delivery_to_return():
    from bubblefree.bench import vlm_timeline
    spans = [("submit", 1.0, 2.0), ("gather", 2.5, 2.6), ("take", 3.5, 3.6), ("tick", 3.6, 9.0),
             ("delivered", 8.0, 8.0), ("take", 12.0, 12.1)]  # the last: the next request's
    assert vlm_timeline.hand_offs(spans, 0.5, 8.75) == {"to decode thread": 1.5, "to caller": 0.75}
    lines = vlm_timeline.trace(spans, [(0.5, 8.75)])
    assert [line.split()[-1] for line in lines] == ["request", "submit", "gather", "take", "tick", "delivered"]
    assert lines[1].split()[:2] == ["500.00", "1500.00"]  # ms from the first window's start
    line = vlm_timeline.show("auto", dict(workload="point", wall_p50=9.0, wall_mean=9.5, parts={"tick": 1.0},
                                          calls={"tick": 2.0}, handoffs={"to caller": 0.25},
                                          device_window_ms=7.5, gc_ms=0.5))
    assert line.endswith("tick 1.00 (x2.0); hand-offs, ms: to caller 0.25; garbage collection 0.50 ms; "
                         "device window 7.50 ms"), line


def test_vlm_timeline_runs_on_the_tiny_model_and_accounts_each_request(capsys):
    from bubblefree import Engine
    from bubblefree.bench import vlm_timeline
    engine = Engine.moondream_random("tiny", device="cpu", pipelined=False)
    try:
        recorder = vlm_timeline.Recorder(engine)
        r = vlm_timeline.measure(engine, recorder, "point", 378, 3, traced=1)
        recorder.spans.clear()
        gc.collect()  # on this (the caller's) thread: a span of its own, apart from the parts
        collections = [w for w, _, _ in recorder.spans]
        recorder.close()
        gc.collect()
        after = [w for w, _, _ in recorder.spans if w.startswith("gc")]
    finally:
        engine.close()
    assert collections == ["gc2 caller"] and after == ["gc2 caller"]  # closed: none recorded since
    calls, parts = r["calls"], r["parts"]
    # Blocking, a point request: one image prefill and one decode step, each launched, waited, finalized.
    assert calls["launch image_prefill"] == 1 and calls["launch decode"] == 1 and calls["image_ref"] == 1
    assert calls["submit"] == 1 and calls["tick"] >= 2
    # Outer spans are their own Python only: nothing of the calls inside them is counted twice.
    assert all(v >= 0 for k, v in parts.items() if k != "rest"), parts
    assert "pipelined=False" in vlm_timeline.show("False", r)
    # Each request is taken after its submit and answered after its delivery.
    assert r["handoffs"]["to decode thread"] > 0 and r["handoffs"]["to caller"] > 0
    assert sum(line.endswith("== request") for line in r["trace"]) == 1
    assert sum(line.endswith("launch image_prefill") for line in r["trace"]) == 1
    # The decode thread waited idle before the request and was notified by its submit.
    assert any(line.endswith("idle") for line in r["trace"]) and any(line.endswith("notify") for line in r["trace"])
    assert not any(k.split()[0] in vlm_timeline.APART or k.startswith("gc") for k in r["parts"]), r["parts"]
    assert r["gc_ms"] >= 0


def test_vlm_timeline_with_several_callers_sums_the_runs_spans_per_request(capsys):
    """``--streams``: N callers at once; every launch counted by kind and
    rows, the decode thread's spans apart from the callers', each image
    prefill's rows and the modes run A B B A with ``--rounds 2``."""
    from bubblefree import Engine
    from bubblefree.bench import vlm_timeline
    engine = Engine.moondream_random("tiny", device="cpu", pipelined="auto")
    try:
        recorder = vlm_timeline.Recorder(engine)
        r = vlm_timeline.measure_streams(engine, recorder, "point", 378, 8, 3, seed=5)
        recorder.close()
    finally:
        engine.close()
    prefills = [rows for kind, rows in recorder.launched if kind == "image_prefill"]
    assert r["prefills"] * 8 == len(prefills) and sum(prefills) == 8  # every request prefilled once
    assert r["prefill_rows"] == pytest.approx(8 / len(prefills))
    assert r["req_s"] > 0 and r["ahead"] == r["unweighed"] == 0 and r["behind"] > 0  # on the CPU auto never goes ahead
    assert r["why"] is None  # nor weighs anything: a launch there computes its step
    assert all(v >= 0 for v in r["parts"].values()), r["parts"]
    line = vlm_timeline.show_streams("auto", 3, r)
    weighed = vlm_timeline.show_streams("auto", 3, dict(r, why=dict(
        rows=5, zombies=1.1, follow=0.26, bubble_ms=1.9, zombie_cost_ms=0.48)))
    assert "behind " + str(r["behind"]) + " (medians there: rows 5, zombies 1.10, follow 0.26, " \
        "bubble 1.90 ms, zombie cost 0.48 ms), unweighed 0;" in weighed
    own, callers = line.split("decode thread, ms a request: ")[1].split("; callers")
    assert "launch image_prefill" in own and "image_ref" not in own and "image_ref" in callers
    vlm_timeline.main(["--tiny", "--streams", "2", "--requests", "4", "--workloads", "point",
                       "--modes", "True,False", "--rounds", "2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("point")]
    assert [line.split()[1] for line in lines] == ["pipelined=True", "pipelined=False",
                                                   "pipelined=False", "pipelined=True"]
    with pytest.raises(SystemExit):
        vlm_timeline.main(["--tiny", "--streams", "2", "--trace", "1"])


def test_llava_speed_serves_the_peers_model_against_its_generate_and_writes_its_section(tmp_path):
    """bench.llava_speed: the same tiny LLaVA served and through ``generate``
    (the attention switched for the peer's turn and back), every mode giving
    the same tokens; its section written between its markers."""
    from bubblefree.bench import llava_speed

    out, record = tmp_path / "bench.md", tmp_path / "run.json"
    out.write_text("# Speed benchmarks\n\nearlier text\n")
    text = llava_speed.main(["--quick", "--streams", "1,3", "--tokens", "3", "--reps", "1",
                             "--out", str(out), "--record", str(record)])
    doc = out.read_text()
    assert "earlier text" in doc and llava_speed.BEGIN in doc and llava_speed.END in doc
    assert "| 3 | 1 |" in text and "| 3 | 3 |" in text and "A smoke run, not a measurement" in text
    rec = json.loads(record.read_text())
    assert [r["streams"] for r in rec["rows"]] == [1, 3]
    assert all(r["same_tokens"] for r in rec["rows"])
    assert all(r["peer"]["req_s"] > 0 for r in rec["rows"])
    assert "vision tower in eager buckets by image count, up to 8 a replay" in rec["model"]  # no CUDA


def test_vlm_speed_past_its_budget_lists_the_cells_left_and_still_writes_its_table(tmp_path):
    record = tmp_path / "run.json"
    text = vlm_speed.main(["--quick", "--device", "cpu", "--streams", "1,8", "--sizes", "378",
                           "--workloads", "point", "--per-stream", "1", "--budget", "0",
                           "--record", str(record)])
    rows = json.loads(record.read_text())["rows"]
    assert [(r["streams"], r["error"]) for r in rows] == [(1, "skipped: time budget"), (8, "skipped: time budget")]
    assert "| point | 378 px | 1 | skipped: time budget |" in text
    assert "| point | 378 px | 8 | skipped: time budget |" in text
    peer = json.loads(record.read_text())["peer"]  # the peer skipped too, and says so
    assert [(w, n, v) for w, n, v in peer] == [("point", n, {"error": "skipped: time budget"}) for n in (1, 8)]
    with pytest.raises(SystemExit):
        vlm_speed.main(["--quick", "--device", "cpu", "--budget", "-1"])


def test_the_switch_interval_holds_for_the_cells_and_is_given_back(monkeypatch, tmp_path):
    """--switch-interval is the interpreter's while the cells run (a cell
    that raises included) and Python's again after, for the peer and the
    caller; a value outside (0, 1) seconds is refused by name. Each cell
    is given its place in the grid, the turn of its runs' order."""
    seen, turns = [], []

    def measure(engine, workload, side, streams, count, seed, rounds=1, turn=0):
        seen.append(sys.getswitchinterval())
        turns.append(turn)
        raise RuntimeError("a cell that fails")

    monkeypatch.setattr(vlm_speed, "measure", measure)
    before = sys.getswitchinterval()
    vlm_speed.main(["--quick", "--no-peer", "--device", "cpu", "--streams", "1,2", "--sizes", "378",
                    "--workloads", "point", "--switch-interval", "0.0005", "--record", str(tmp_path / "r.json")])
    assert seen == [0.0005, 0.0005] and sys.getswitchinterval() == before
    assert turns == [0, 1]  # a cell that failed still took its turn
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["error"] for r in rows] == ["RuntimeError: a cell that fails"] * 2
    for bad in ("0", "1", "-0.001", "nan"):
        with pytest.raises(SystemExit):
            vlm_speed.main(["--quick", "--device", "cpu", "--switch-interval", bad])
