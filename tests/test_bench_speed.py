"""The speed benchmark runs end to end on the CPU (tiny model), so it cannot rot.

The numbers mean nothing here; what is checked is that every cell of the
three modes is measured, the peers are reported (as not applicable without CUDA),
the docs entry and the JSON lines are written, and the seed's model is run.
"""

import json

from bubblefree.bench import speed
from bubblefree.bench.speed_cells import Cycle, bin_masks, zombie_stats


def test_speed_bench_runs_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
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
