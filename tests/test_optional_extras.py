"""A test file that cannot import an optional extra's package is skipped by
name outside CI, and fails under CI (``conftest``, ``optional_extras``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from optional_extras import EXTRAS, NO_DEPS, skip_reason

HERE = Path(__file__).parent


def _missing(module: str) -> str:
    return ("ImportError while importing test module\n"
            f"E   ModuleNotFoundError: No module named '{module}'")


@pytest.mark.parametrize("module,extra", [("fastapi", "server"), ("uvicorn", "server"),
                                          ("PIL.Image", "images"), ("openai", "test"),
                                          ("ray.serve", "ray")])
def test_a_missing_extras_package_names_its_extra_outside_ci(module, extra):
    assert skip_reason(_missing(module), ci=False) == (f"needs the {extra} extra ({module}): "
                                                       f"pip install 'bubblefree[{extra}]'")
    assert skip_reason(_missing(module), ci=True) is None  # all installed there: a failure


def test_moondreams_client_is_named_with_how_the_makefile_installs_it():
    assert skip_reason(_missing("moondream"), ci=False) == (
        "needs moondream's package (moondream): pip install --no-deps moondream")
    assert skip_reason(_missing("moondream"), ci=True) is None


@pytest.mark.parametrize("error", [
    "E   ModuleNotFoundError: No module named 'fastap'",  # a typo is not an extra
    "E   ModuleNotFoundError: No module named 'bubblefree.servr'",
    "E   ImportError: cannot import name 'app' from 'fastapi'",  # there, but broken
    "E   SyntaxError: invalid syntax",
    ""])
def test_any_other_collection_error_stays_an_error(error):
    assert skip_reason(error, ci=False) is None


def test_every_extra_named_is_one_the_package_declares():
    text = (HERE.parent / "pyproject.toml").read_text()
    for extra in set(EXTRAS.values()):
        assert f"\n{extra} = [" in text, extra
    for package in NO_DEPS:
        assert f"--no-deps {package}" in (HERE.parent / "Makefile").read_text(), package


def _run(tmp_path, ci: bool) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "optional_extras.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_needs_server.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n")
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_collection_skips_the_file_by_its_extra_outside_ci_and_fails_under_ci(tmp_path):
    run = _run(tmp_path, ci=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 1 skipped" in run.stdout
    assert "needs the server extra (fastapi): pip install 'bubblefree[server]'" in run.stdout
    run = _run(tmp_path, ci=True)
    assert run.returncode != 0 and "1 error" in run.stdout, run.stdout + run.stderr
    assert "No module named 'fastapi'" in run.stdout
