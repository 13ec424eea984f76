"""The CPU benchmark commands run end to end, so they cannot rot."""

import pytest

from bubblefree.bench import auto_sim, bookkeeping, fake_pipeline


def test_fake_pipeline_demo_runs_and_modes_agree(capsys):
    assert fake_pipeline.main(["--requests", "9", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "| pipelined | 9 | 9 |" in out and "| blocking | 9 | 9 |" in out
    assert "| yes |" in out


def test_bookkeeping_bench_prints_every_stream_count(tmp_path):
    out = tmp_path / "b.md"
    table = bookkeeping.main(["--tokens", "4", "--repeats", "1", "--out", str(out)])
    for streams in bookkeeping.STREAMS:
        for mode in ("pipelined", "blocking", "auto"):
            assert f"| {streams} | {mode} |" in table
    assert "Core bookkeeping" in out.read_text()
    for rows in bookkeeping.STREAMS:  # the backend's packing, at the same row counts
        assert f"| {rows} | " in table.split("pack_decode")[1]


def test_auto_sim_prints_every_cell_and_appends_its_table(tmp_path):
    out = tmp_path / "a.md"
    table = auto_sim.main(["--seeds", "1", "--per-stream", "2", "--streams", "1,2", "--out", str(out)])
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(auto_sim.REGIMES) * len(auto_sim.SKILLS) * len(auto_sim.CALLERS) * 2
    assert "--streams 1,2" in out.read_text() and table in out.read_text()


def test_auto_sim_runs_each_mode_on_the_same_ends():
    # The skill's ends come from its own seeded stream, so a request ends at
    # the same token in every mode (the table compares like with like).
    regime = auto_sim.REGIMES[0]
    reqs = auto_sim.requests(0.5, 6, seed=1)
    runs = [auto_sim.run(mode, regime, 2, reqs) for mode, _ in auto_sim.MODES]
    assert runs[0][1] == runs[1][1] == runs[2][1]
    assert len({len(tokens) for tokens in runs[0][1]}) > 1  # the ends vary between requests
    assert runs[0][0] != runs[1][0]  # and the orders' times differ


def test_auto_sim_with_an_inbox_lets_the_core_count_requests_due_during_a_tick(monkeypatch):
    """``--inbox``: a caller's request due while a tick runs is counted by
    ``Engine.arrivals`` when auto chooses (as the serving loop's inbox is),
    and still submitted between ticks: every mode gives the same outputs."""
    import bubblefree.core.engine as core_engine
    seen = []
    choose = core_engine.choose

    def counting(*args):
        seen.append(args[-1])  # the arrivals the rule was given
        return choose(*args)

    monkeypatch.setattr(core_engine, "choose", counting)
    regime, reqs = auto_sim.REGIMES[0], auto_sim.requests(0.5, 12, seed=2)
    runs = [auto_sim.run(mode, regime, 4, reqs, think=1.0, inbox=True) for mode, _ in auto_sim.MODES]
    assert runs[0][1] == runs[1][1] == runs[2][1]
    assert max(seen) > 0  # some requests came due during a tick
    seen.clear()
    auto_sim.run("auto", regime, 4, reqs, think=1.0)
    assert set(seen) == {0}  # without the inbox the core never sees one
    table = auto_sim.main(["--seeds", "1", "--per-stream", "2", "--streams", "2", "--inbox",
                           "--skills", "point", "--out", ""])
    assert "auto >= 0.98x" in table


def test_auto_sim_charges_the_rule_s_host_work_and_weighs_it_unless_told_every_tick():
    """``--choose-cost``: the rule's host work a row, on the simulated host's
    clock. Host-bound text at 32 streams, where pipelined is the better:
    weighed at every tick (``--every-tick``), auto takes about the charge
    longer a tick; with ``core.ahead_measures.Worth`` most ticks go unweighed and it
    comes back to pipelined's time. Every mode gives the same outputs."""
    regime = [r for r in auto_sim.REGIMES if r[0] == "host-bound"][0]
    reqs = auto_sim.requests(0.02, 64, seed=3)
    pipelined, out = auto_sim.run(True, regime, 32, reqs, choose_cost=0.001)
    every, out_every = auto_sim.run("auto", regime, 32, reqs, choose_cost=0.001, every_tick=True)
    worth, out_worth = auto_sim.run("auto", regime, 32, reqs, choose_cost=0.001)
    free, _ = auto_sim.run("auto", regime, 32, reqs)
    assert out == out_every == out_worth
    assert pipelined / every < 0.98 <= pipelined / worth
    assert free <= worth < every
    table = auto_sim.main(["--seeds", "1", "--per-stream", "2", "--streams", "2", "--skills", "point",
                           "--choose-cost", "0.001", "--every-tick", "--out", ""])
    assert "auto >= 0.98x" in table


def test_tests_skipped_without_the_gpus_parts_are_marked_gpu():
    """``pytest -m gpu`` (``bench/gpu_run.sh``) selects every test whose skip
    names CUDA, a GPU, Triton or sm_90, and no other: the marker is derived
    from the reason, so no list of files goes stale."""
    from tests.conftest import pytest_collection_modifyitems

    class Item:
        def __init__(self, *reasons):
            self.marks = [pytest.mark.skipif(True, reason=r).mark for r in reasons]

        def iter_markers(self, name):
            return iter([m for m in self.marks if m.name == name])

        def add_marker(self, mark):
            self.marks.append(mark.mark)

    items = [Item("needs CUDA: Triton kernels"), Item("needs a GPU of compute capability 9"),
             Item("needs Triton's ptxas to compile for sm_90"), Item("the ray extra"), Item(),
             Item("the client left", "needs CUDA: a real shape's step")]
    pytest_collection_modifyitems(None, items)
    assert [any(m.name == "gpu" for m in item.marks) for item in items] == \
        [True, True, True, False, False, True]


@pytest.mark.parametrize("argv,why", [(["--rounds", "1"], "--rounds: at least 2"),
                                      (["--rounds", "-5"], "--rounds: at least 2"),
                                      (["--rounds", "two"], "invalid int value")])
def test_grid_wait_refuses_bad_rounds_by_name(capsys, argv, why):
    from bubblefree.bench import grid_wait
    with pytest.raises(SystemExit):
        grid_wait.main(argv)
    assert why in capsys.readouterr().err


def test_grid_wait_without_a_gpu_says_what_it_needs(capsys, monkeypatch):
    import torch

    from bubblefree.bench import grid_wait
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        grid_wait.main([])
    assert "needs a CUDA GPU and Triton" in capsys.readouterr().err


def test_the_sampling_bench_times_each_kind_of_draw_beside_transformers_and_writes_its_section(tmp_path, capsys):
    from bubblefree.bench import sampling
    out = tmp_path / "benchmarks.md"
    out.write_text("# Speed benchmarks\n\nearlier runs\n")
    text = sampling.main(["--vocab", "256", "--rows", "1,3", "--repeats", "2", "--device", "cpu",
                          "--out", str(out)])
    for rows in (1, 3):
        for label in ([c[0] for c in sampling.CASES if not c[4]] + [sampling.PEER]
                      + [label for label, _ in sampling.pieces(256)]):
            line = next(x for x in text.splitlines() if x.startswith(f"| {rows} | {label} |"))
            us = float(line.split("|")[3].replace(",", ""))
            assert us > 0 and line.endswith("| eager |"), line
        for label in [c[0] for c in sampling.CASES if c[4]]:  # Triton's kernels: CUDA only
            assert f"| {rows} | {label} |" not in text
    doc = out.read_text()
    assert doc.startswith("# Speed benchmarks\n\nearlier runs\n") and text in doc
    sampling.main(["--vocab", "256", "--rows", "2", "--repeats", "1", "--device", "cpu", "--out", str(out)])
    assert doc.count(sampling.BEGIN) == 1 and out.read_text().count("| 2 | greedy |") == 1  # replaced
    assert "| 1 | greedy |" not in out.read_text()
    assert text.splitlines()[-1] in capsys.readouterr().out
