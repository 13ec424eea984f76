"""The CPU benchmark commands run end to end, so they cannot rot."""

from bubblefree.bench import bookkeeping, fake_pipeline


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
