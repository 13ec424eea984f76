"""The one-call GPU scripts (``bench/*.sh``) are read by bash before a
lent GPU's time is spent on them: each must parse, and the whole grid's
runs every shape with the grid's arguments and keeps each shape's output."""

import os
import subprocess
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("*.sh"))


def test_there_are_scripts_to_check():
    assert BENCH.joinpath("grid_run.sh") in SCRIPTS and len(SCRIPTS) > 5


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_whole_grid_runs_each_shape_with_the_grids_arguments(tmp_path):
    """Stand-ins for ``python3`` and ``nvidia-smi`` log their arguments; the
    script's own lines (the machine, the auto summaries) still run."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "calls.txt"
    (stubs / "python3").write_text(
        f'#!/usr/bin/env bash\necho "$*" >> "{log}"\n'
        'case "$*" in *bench.speed*) echo "auto >= 0.98 x the better of pipelined and blocking '
        'in 16 of 16 cells";; esac\n')
    (stubs / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA H200, 0, 0 MiB'\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", OUT=str(out), MODELS="phi qwen05b")
    done = subprocess.run(["bash", str(BENCH / "grid_run.sh")], cwd=BENCH.parent, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [line for line in log.read_text().splitlines() if "bench.speed" in line]
    assert [c.split("--model ")[1].split()[0] for c in calls] == ["phi", "qwen05b"]
    for call in calls:
        for arg in ("--streams 1,8,32,64", "--repeats 3", "--peer-streams 1,32", "--out  --plot "):
            assert arg in call, (arg, call)
    assert done.stdout.count("in 16 of 16 cells") == 2
    assert {p.name for p in out.iterdir()} == {"machine.txt", "speed-phi.txt", "speed-qwen05b.txt"}
    assert "NVIDIA H200" in (out / "machine.txt").read_text()
