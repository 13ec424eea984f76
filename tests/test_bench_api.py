"""``bench.api_speed`` on the CPU: both ways run, agree, and write their table."""

from __future__ import annotations

from bubblefree.bench import api_speed


def test_api_speed_runs_both_ways_and_writes_its_table(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Speed benchmarks\n\nearlier runs stay\n")
    text = api_speed.main(["--tiny", "--quick", "--streams", "1,3", "--workloads", "text,detect",
                           "--repeats", "1", "--out", str(doc)])
    rows = [line for line in text.splitlines() if line.startswith(("| text |", "| detect |"))]
    assert len(rows) == 4 and all("error" not in r for r in rows), text
    # I8 across the two ways (fp32 on the CPU): every request gave the same tokens.
    for r in rows:
        same, total = r.rstrip(" |").rsplit("|", 1)[1].strip().split("/")
        assert same == total, r
    written = doc.read_text()
    assert "earlier runs stay" in written and api_speed.BEGIN in written and rows[0] in written
    api_speed.main(["--tiny", "--quick", "--streams", "1", "--workloads", "text", "--repeats", "1",
                    "--out", str(doc)])
    assert doc.read_text().count(api_speed.BEGIN) == 1  # a new run replaces its section
