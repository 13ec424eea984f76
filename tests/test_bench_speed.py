"""The speed benchmark runs end to end on the CPU (tiny model), so it cannot rot.

The numbers mean nothing here; what is checked is that every cell of the
three modes is measured, the peers are reported (as not applicable without CUDA),
the docs entry and the JSON lines are written, and the seed's model is run.
"""

import gc
import json
import statistics

import attrs
import pytest
import torch
import transformers

from bubblefree.bench import speed, speed_report
from bubblefree.bench.speed_cells import Collections, Cycle, bin_masks, zombie_stats
from bubblefree.bench.speed_setup import SHAPES, weight_bytes
from bubblefree.cuda_backend.backend import CudaBackend


def test_speed_bench_runs_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    # On a CPU the backend's launches compute their steps (``Capacity.
    # asynchronous`` False) and auto commits at every tick without weighing
    # anything (test_cuda_backend). Declared asynchronous here, the rule runs
    # as on a GPU, so its inputs' reporting (``behind_why``) is checked end
    # to end.
    monkeypatch.setattr(CudaBackend, "capacity",
                        property(lambda self: attrs.evolve(self._cap, asynchronous=True)))
    out = tmp_path / "benchmarks.md"
    table = speed.main(["--tiny", "--quick", "--out", str(out), "--plot", ""])
    for workload in ("text", "detect", "point", "mix"):
        for streams in (1, 8):
            for mode in ("pipelined", "blocking", "auto"):
                row = next(line for line in table.splitlines()
                           if line.startswith(f"| {workload} | {streams} | {mode} |"))
                assert "error" not in row and "skipped" not in row, row
    for peer in ("hf generate (static cache)", "hf continuous batching"):
        assert f"| text | 1 | {peer} |" in table and "n/a: needs CUDA" in table
    doc = out.read_text()
    assert "## Speed, " in doc and table in doc and "python -m bubblefree.bench.speed --tiny --quick" in doc
    assert "The seed's model on the detect workload" in doc
    # what ran is recorded: the fused step (compile is CUDA-only), padded prefill
    assert "decode step: fused phi; prefill: transformers;" in doc
    # the floor is the weights read once at the read bandwidth measured in this run
    assert "read bandwidth " in doc and "read floor " in doc and "bandwidth / 2" not in doc
    floor = next(r for r in (json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines())
                 if r.get("measure") == "floor")
    assert f"÷ read floor ({floor['floor_ms']:.3f} ms at {floor['read_gbps']:,.0f} GB/s)" in table
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith(table.splitlines()[-1])  # the table is printed last
    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    cells = [r for r in lines if r.get("mode") in ("pipelined", "blocking", "auto")]
    assert len(cells) == 4 * 2 * 3
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in cells)
    detect = {r["mode"]: r for r in cells if r["workload"] == "detect" and r["streams"] == 1}
    assert detect["blocking"]["zombie_rows"] == 0  # blocking commits before it launches
    assert detect["pipelined"]["wasted_steps"] == detect["pipelined"]["requests"]  # one per end
    assert detect["pipelined"]["tokens_hash"] == detect["blocking"]["tokens_hash"]  # I8
    assert detect["auto"]["tokens_hash"] == detect["blocking"]["tokens_hash"]
    assert any(r.get("measure") == "seed_model" for r in lines)
    # why auto blocked: the rule's inputs summed up over the run's behind ticks
    from bubblefree.core.engine import BEHIND_KEPT
    for r in cells:
        why = r["behind_why"]
        assert (why is None) == (r["behind_ticks"] == 0), r
        if why is not None:
            assert why["ticks"] == min(r["behind_ticks"], BEHIND_KEPT) and why["zombies"] > 0
            assert why["zombie_cost_ms"] > why["bubble_ms"] * (1 - 1e-9)  # the rule's "behind"
    assert any(r["behind_why"] for r in cells if r["mode"] == "auto")
    # where every run's steps went on the host: each run's figures in its
    # mode's row, the wait and the host's own work making up its step, the
    # choosing auto's alone
    for r in cells:
        assert len(r["tok_s_runs"]) == len(r["host_ms_runs"]) == len(r["choose_ms_runs"]) == 2
        assert r["wait_ms"] >= 0 and r["host_ms"] > 0 and r["gc_ms"] >= 0 and r["gc_count"] >= 0
        assert r["wait_ms"] + r["host_ms"] == pytest.approx(r["wall_s"] / r["steps"] * 1e3)
        chose = [c > 0 for c in r["choose_ms_runs"]]
        assert chose == [r["mode"] == "auto"] * 2, r["mode"]
        assert r["choose_ms"] < r["host_ms"]
    assert printed.count("of which choosing") == 4 * 2 * 3 * 2  # every run's line
    # the rule's running means at each cell's end, per step kind
    for r in cells:
        timed = r["timings"]
        assert timed["commit_ms"] > 0 and timed["launch_ms"]["decode"] > 0 and timed["forward_ms"]["decode"] > 0
        assert 0 <= timed["follow"] <= 1


def test_the_sampled_workload_draws_the_same_tokens_in_every_mode_and_beside_its_peers(tmp_path, monkeypatch):
    """Not in the default grid; asked for, it runs the text drawn at
    ``SAMPLED`` (the same tokens pipelined, blocking and auto: I8 with
    sampling on, seeded per request), and its peers are listed beside it."""
    monkeypatch.setenv("OUT", str(tmp_path))
    table = speed.main(["--tiny", "--quick", "--streams", "1,4", "--workloads", "text,sampled",
                        "--out", "", "--plot", ""])
    lines = [json.loads(x) for x in (tmp_path / "bench.jsonl").read_text().splitlines()]
    cells = [r for r in lines if r.get("mode") in ("pipelined", "blocking", "auto")]
    assert {r["workload"] for r in cells} == {"text", "sampled"}
    for streams in (1, 4):
        drawn = {r["mode"]: r["tokens_hash"] for r in cells if r["workload"] == "sampled" and r["streams"] == streams}
        greedy = {r["tokens_hash"] for r in cells if r["workload"] == "text" and r["streams"] == streams}
        assert len(drawn) == 3 and len(set(drawn.values())) == 1 and set(drawn.values()) != greedy
    for peer in ("hf generate (static cache)", "hf continuous batching"):
        assert f"| sampled | 1 | {peer} |" in table
    assert "sampled" not in speed.parse([]).workloads


def test_the_peers_draw_with_the_workloads_settings_and_no_top_k_of_their_own():
    from bubblefree.bench.peers import _drawing
    from bubblefree.bench.speed_cells import SAMPLED
    assert _drawing(None) == {"do_sample": False}
    assert _drawing(SAMPLED) == {"do_sample": True, "top_k": 0, "temperature": 0.7, "top_p": 0.9}


def test_cycle_walks_three_disjoint_masks():
    masks = bin_masks(512)
    assert all(len(m) == 64 for m in masks) and not (masks[0] & masks[1] or masks[1] & masks[2])
    state = Cycle((5, 6, 7), 4)
    seen = []
    for _ in range(4):
        seen.append(state.mask_id())
        done = state.advance(0, None)
    assert seen == [5, 6, 7, 5] and done


def test_zombie_stats_counts_rows_after_the_end():
    trace = [("launch", 0, "prefill", 0, (0, 1)), ("launch", 1, "decode", 1, (0, 1)),
             ("launch", 2, "decode", 0, (0, 1)), ("launch", 3, "decode", 1, (1,))]
    # seq 0 committed 2 tokens (step 2 was a zombie row); seq 1 committed 3 (step 3 wasted)
    assert zombie_stats(trace, {0: 2, 1: 3}) == (4, 2, 1)


def test_the_model_shape_is_an_argument():
    assert speed.parse([]).model == "phi"
    assert speed.parse(["--model", "llama1b", "--tiny"]).model == "llama1b"
    assert speed.parse(["--model", "qwen05b"]).model == "qwen05b"
    with pytest.raises(SystemExit):
        speed.parse(["--model", "gpt2"])


@pytest.mark.parametrize("flag,field,rows", [("--pdl-rows", "pdl_rows", 4),
                                             ("--o-combines", "o_combines", 0),
                                             ("--sample-ahead", "sample_ahead", 0)])
def test_the_kernel_configs_row_counts_are_counts(flag, field, rows, capsys):
    """The dependent step's rows, where its output projection combines split
    attention, and where steps sample ahead: as given, or as measured when
    not; never negative."""
    assert getattr(speed.parse([]), field) is None
    kernels = speed.decode_options(speed.parse([flag, str(rows)]), torch.device("cpu"), None)
    assert getattr(kernels["kernels"], field) == rows
    with pytest.raises(SystemExit):
        speed.parse([flag, "-1"])
    assert f"{flag} is a row count (0: none), not -1" in capsys.readouterr().err


def test_a_variant_sets_the_kernels_as_step_ab_would_and_names_what_is_wrong(monkeypatch):
    """``--variant`` gives the kernels bench.step_ab's variant would: row
    counts anywhere, tiles where a dependent-launch step runs; a tile the
    config cannot take ends the run naming it, before any model is built."""
    from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile
    cpu = torch.device("cpu")
    kernels = speed.decode_options(speed.parse(["--variant", "sample_ahead=0+o_combines=1"]),
                                   cpu, None)["kernels"]
    assert (kernels.sample_ahead, kernels.o_combines) == (0, 1)
    with pytest.raises(SystemExit, match="no dependent-launch step"):
        speed.decode_options(speed.parse(["--variant", "896,1152=32n128k2s4w3p"]), cpu, None)
    hopper = attrs.evolve(KernelConfig(), pdl_rows=8)
    monkeypatch.setattr(speed.KernelConfig, "measured", lambda device, config: hopper)
    kernels = speed.decode_options(speed.parse(["--variant", "896,1152=32n128k2s4w3p"]), cpu,
                                   None)["kernels"]
    assert kernels.pdl_tiles.tile_for(8, 896, 1152) == Tile(32, 128, 2, 4, 3)
    assert kernels.pdl_tiles.tile_for(9, 896, 1152) is None
    for bad, why in (("896,9728=32n128k9s4w3p", "does not cut K=896"),
                     ("896=32n128k2s4w3p", "is not K,N=TILE"), ("pdl_rows=x", "row count")):
        with pytest.raises(SystemExit, match=why):
            speed.decode_options(speed.parse(["--variant", bad]), cpu, None)


@pytest.mark.parametrize("shape, gigabytes, layers, tied", [
    ("phi", 2.837, 24, False), ("llama1b", 2.472, 16, True), ("qwen05b", 0.988, 24, True)])
def test_each_shape_has_its_published_size(shape, gigabytes, layers, tied):
    """Built on the meta device: the shapes only, no memory, no weights."""
    spec = SHAPES[shape]
    with torch.device("meta"):
        model = getattr(transformers, spec["cls"])(spec["config"]()).to(torch.bfloat16)
    assert round(weight_bytes(model) / 1e9, 3) == gigabytes
    assert model.config.num_hidden_layers == layers
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_the_read_floor_is_the_weights_at_the_read_bandwidth():
    floor = speed.read_floor(2_000_000_000, 4e12, "a probe")
    assert floor == dict(read_gbps=4000.0, probe="a probe", weight_gb=2.0, floor_ms=0.5)


def _cell(mode, ms_step, tok_s):
    return dict(workload="text", streams=1, mode=mode, requests=4, tok_s=tok_s, req_s=1.0,
                ms_step=ms_step, idle_ms=0.01, p50_ms=10.0, p99_ms=12.0)


def test_the_table_divides_each_step_by_the_read_floor():
    rows = [_cell("pipelined", 0.75, 1200.0), _cell("blocking", 1.0, 1000.0),
            dict(workload="text", streams=8, mode="pipelined", error="skipped: time budget")]
    table = speed_report.main_table(rows, 0.5, 4000.0).splitlines()
    assert "| ÷ read floor (0.500 ms at 4,000 GB/s) |" in table[0]
    cells = {tuple(line.split(" | ")[1:3]): line.split(" | ") for line in table[2:]}
    column = table[0].split(" | ").index("÷ read floor (0.500 ms at 4,000 GB/s)")
    assert cells["1", "pipelined"][column] == "1.50" and cells["1", "blocking"][column] == "2.00"
    assert len(table) == 5 and "skipped: time budget" in table[-1]


def test_the_auto_summary_counts_each_cell_against_its_better_mode():
    def cell(workload, streams, mode, tok_s):
        return dict(_cell(mode, 1.0, tok_s), workload=workload, streams=streams)
    rows = [cell("text", 1, "pipelined", 1000.0), cell("text", 1, "blocking", 900.0),
            cell("text", 1, "auto", 985.0),  # 0.985 of pipelined: counted as met
            cell("point", 1, "pipelined", 800.0), cell("point", 1, "blocking", 900.0),
            cell("point", 1, "auto", 870.0),  # 0.967 of blocking, the better there: under
            cell("text", 8, "pipelined", 1000.0),
            dict(workload="text", streams=8, mode="blocking", error="skipped: time budget"),
            cell("text", 8, "auto", 1000.0),
            cell("text", 1, "hf generate (static cache)", 300.0)]  # a peer is no cell of the three
    line = speed_report.auto_summary(rows)
    assert line.startswith("auto >= 0.98 x the better of pipelined and blocking in 1 of 2 cells")
    assert "(under: point x1 0.967)" in line and "not all three modes ran in text x8" in line
    assert speed_report.auto_summary(rows[6:]).endswith("no cell ran all three modes")
    # A cell under the line names each mode's host work run by run, where kept.
    for row, host in zip(rows[3:6], ([0.5, 0.6, 0.7], [0.5, 0.5, 0.6], [1.2, 1.1, 0.7])):
        row["host_ms_runs"] = host
    line = speed_report.auto_summary(rows)
    assert ("(under: point x1 0.967 [host ms a step by run: pipelined 0.50 0.60 0.70; "
            "blocking 0.50 0.50 0.60; auto 1.20 1.10 0.70])") in line
    assert "text x1 0.985" not in line  # a cell that met the line says nothing more


def test_without_a_floor_the_column_says_so():
    table = speed_report.main_table([_cell("blocking", 1.0, 1000.0)], None, None).splitlines()
    assert "| ÷ read floor |" in table[0]
    assert table[2].split(" | ")[8] == "—"


def test_the_docs_header_names_the_read_bandwidth_and_the_floor():
    env = dict(device="NVIDIA H200", torch="2.11", transformers="5.17", model="a shape")
    floor = speed.read_floor(2_837_000_000, 4.19e12, "torch's sum over 4.29 GB of float32, best of 10")
    text = speed_report.header(env, "python -m bubblefree.bench.speed --model phi", floor, "notes")
    assert "read bandwidth 4,190 GB/s (torch's sum over 4.29 GB of float32, best of 10)" in text
    assert "read floor 0.677 ms/step (weights ÷ read bandwidth" in text
    assert "copy" not in text and "/ 2" not in text


def _runs_in_order(repeats, speed_at, turn=0):
    """Each mode's runs as measure_cell makes them (``run_order``: P B A,
    A B P, ... in the first cell; the last repeat hooked), with tok/s
    ``speed_at(position)``, 1-based."""
    runs = {m: [] for m in speed_report.MODES}
    for position, (i, mode) in enumerate(speed_report.run_order(repeats, turn), 1):
        tok_s = speed_at(position)
        runs[mode].append(dict(tok_s=tok_s, req_s=tok_s / 3, ms_step=1e3 / tok_s, p50_ms=position,
                               hooked=i == repeats - 1))
    return runs


def test_each_cell_runs_every_mode_once_a_repeat_and_the_middle_turns_from_cell_to_cell():
    """``run_order``: every repeat runs the three modes, the first cell's as
    before (P B A, A B P, P B A); in three cells in a row each mode is once
    the one whose two plain runs sit side by side in the middle (3 and 4),
    where one short slow stretch of the host can take both."""
    assert speed_report.run_order(3) == [(0, "pipelined"), (0, "blocking"), (0, "auto"),
                                         (1, "auto"), (1, "blocking"), (1, "pipelined"),
                                         (2, "pipelined"), (2, "blocking"), (2, "auto")]
    middles = []
    for turn in range(6):
        order = speed_report.run_order(3, turn)
        assert all(sorted(m for i, m in order if i == r) == sorted(speed_report.MODES) for r in range(3))
        assert order[2][1] == order[3][1]  # positions 3 and 4: one mode's two plain runs
        middles.append(order[2][1])
    assert sorted(middles[:3]) == sorted(speed_report.MODES) and middles[3:] == middles[:3]


@pytest.mark.parametrize("turn", [0, 1, 2])
@pytest.mark.parametrize("repeats", [3, 5])
@pytest.mark.parametrize("slope", [30.0, -30.0])
def test_a_drift_over_the_cell_moves_every_mode_alike(slope, repeats, turn):
    """The same speed in every mode, drifting run by run: with an even count
    of plain runs the modes' rows agree, whichever mode the cell's order
    starts with. The upper median of two plain runs gave the mode at the
    ends of the order its most drifted run (positions 1 and 6 against the
    middle mode's 3 and 4): 1180 against 1120 rising."""
    runs = _runs_in_order(repeats, lambda at: 1000.0 + slope * at, turn)
    rows = {m: speed_report.mode_row(rs) for m, rs in runs.items()}
    assert len({round(r["tok_s"], 6) for r in rows.values()}) == 1
    middle = 3 * (repeats - 1) / 2 + 0.5  # the mean position of every mode's plain runs
    assert rows["pipelined"]["tok_s"] == pytest.approx(1000.0 + slope * middle)
    if repeats == 3:
        ends, inner = speed_report.MODES[turn], speed_report.MODES[(turn + 2) % 3]
        upper = {m: max(r["tok_s"] for r in rs if not r["hooked"]) for m, rs in runs.items()}
        assert upper[ends] - upper[inner] == pytest.approx(2 * abs(slope))


def test_one_stalled_run_of_four_moves_a_mode_s_row_by_no_more_than_its_neighbours():
    """Five repeats, a steady 1000 tok/s but one of auto's plain runs
    stalled at a quarter: the row holds at the neighbours' 1000, where a
    mean of the four would fall to 812.5, under the line against the
    others' 1000."""
    runs = _runs_in_order(5, lambda at: 250.0 if at == 3 else 1000.0)  # position 3: auto's first
    assert [r["tok_s"] for r in runs["auto"]][0] == 250.0
    rows = {m: speed_report.mode_row(rs) for m, rs in runs.items()}
    assert {m: r["tok_s"] for m, r in rows.items()} == dict.fromkeys(speed_report.MODES, 1000.0)
    assert statistics.fmean(r["tok_s"] for r in runs["auto"] if not r["hooked"]) == 812.5


def test_a_mode_row_takes_the_median_of_its_plain_runs_and_the_upper_median_s_fields():
    runs = [dict(tok_s=900.0, req_s=300.0, ms_step=2.0, p50_ms=5.0, hooked=False),
            dict(tok_s=1100.0, req_s=400.0, ms_step=1.0, p50_ms=4.0, hooked=False),
            dict(tok_s=5000.0, req_s=900.0, ms_step=0.1, p50_ms=1.0, hooked=True)]
    row = speed_report.mode_row(runs)
    assert (row["tok_s"], row["req_s"], row["ms_step"]) == (1000.0, 350.0, 1.5)  # the hooked run is left out
    assert row["p50_ms"] == 4.0 and row["tok_s_runs"] == [900.0, 1100.0, 5000.0]
    only = speed_report.mode_row([dict(tok_s=700.0, req_s=1.0, ms_step=3.0, hooked=True)])
    assert only["tok_s"] == 700.0  # one run, hooked: that run


def test_collections_counts_the_garbage_collections_inside_and_stops_listening_after():
    with Collections() as seen:
        gc.collect()
        gc.collect()
    assert seen.count == 2 and seen.seconds > 0
    gc.collect()
    assert seen.count == 2
    with pytest.raises(ZeroDivisionError), Collections() as raised:
        1 / 0
    assert raised._seen not in gc.callbacks and seen._seen not in gc.callbacks
