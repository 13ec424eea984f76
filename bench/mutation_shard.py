"""One shard of the mutation run: mutmut under a wall-clock budget, its
results kept in a small file, and shards' files merged.

A full run of the three packages (about 3,470 mutants) takes hours on two
CPUs. On a machine with many CPUs it fits in a few commands of a few minutes
each, one shard per command, selected with ``--only`` (mutmut's wildcards
over the mutant names, which start with the module: ``'bubblefree.core*'``,
``'bubblefree.fake_backend*'``, ``'bubblefree.loop*'``).

mutmut writes a file's results (``mutants/<path>.meta``) after each mutant
it finishes, so a run stopped at its budget keeps every finished mutant;
those cut off stay "not checked" and are reported so. The stop kills
mutmut's main process before its workers, so a half-finished mutant is never
recorded as killed. A ``.meta`` file caught half-written by the stop is
read from the last copy that parsed (they are read every few seconds while
mutmut runs).

The shard file records, for each selected mutant, its source file, status
and seconds, and for each one that was checked and not killed its change
(read from ``mutants/`` while it is there), so the report can be written on
another machine from the files alone.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

FORMAT = 1
# Each package's modules as mutmut names its mutants: by import name, so the
# layers reached through bubblefree/'s symlinks are `bubblefree.core...`,
# and the serving layer's own files in bubblefree/ `bubblefree.loop...`.
# pyproject.toml's source_paths list the same files.
PACKAGES = {
    "core": ("bubblefree.core",),
    "fake_backend": ("bubblefree.fake_backend",),
    "serving": ("bubblefree.loop", "bubblefree.engine", "bubblefree.handle", "bubblefree.streams"),
}
# What mutmut's own score counts as killed (`mutmut badge`: killed and
# timeout over every mutant not skipped); a segfault, or a test run killed
# at its hard CPU limit, which mutmut also calls one, is not.
KILLED = {"killed", "timeout"}
UNRUN = {"not checked", "skipped"}


def module_of(name: str) -> str:
    """``bubblefree.core.scheduler.xǁSchedulerǁcommit__mutmut_12`` -> ``bubblefree.core.scheduler``."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].startswith(("x_", "xǁ")):
            return ".".join(parts[:i])
    raise ValueError(f"{name!r} is not a mutant's name")


def package_of(name: str) -> str | None:
    """The package in ``PACKAGES`` that a mutant belongs to, if any."""
    module = module_of(name)
    for package, modules in PACKAGES.items():
        if any(module == m or module.startswith(m + ".") for m in modules):
            return package
    return None
# mutmut's command line, with its timeout set from the first argument when
# one is given (mutmut reads it from pyproject.toml only). mutmut times a
# mutant out after (its tests' time in mutmut's stats run + 1 s) x 15. The
# stats run records every call, which makes the tests some 3-4 times slower
# than in a mutant's run, so (that time + 5 s) x 1 still leaves room, and a
# mutated loop that never ends (there are several) then holds a worker for
# minutes, not an hour. The 5 s cover a fast test's start in a busy worker.
TIMEOUT_CONSTANT_S = 5.0
LAUNCH = f"""import sys
from mutmut.__main__ import cli
from mutmut.configuration import config
multiplier = sys.argv.pop(1)
if multiplier:
    config().timeout_multiplier = float(multiplier)
    config().timeout_constant = {TIMEOUT_CONSTANT_S}
sys.argv[0] = "mutmut"
cli()
"""
# How a shard's results were made, when they were read from an earlier run.
NO_RUN = dict(wall_s=0.0, stopped_at_budget=False, timeout_multiplier=None, exit_code=None, phases_s={})
# mutmut's phases, as its output names them, for the progress lines.
PHASES = ("Generating mutants", "Running stats", "Running clean tests", "Running forced fail test",
          "Running mutation testing")


def selected(name: str, only: list[str]) -> bool:
    """As mutmut selects mutants by the names given to ``mutmut run``."""
    return not only or any(name == o or fnmatch.fnmatch(name, o) for o in only)


def read_meta(root: Path, last: dict[Path, dict]) -> dict[str, dict]:
    """``{mutant: {"path", "code", "s"}}`` from every ``.meta`` file under
    ``root/mutants``; a file that does not parse is taken from ``last`` (the
    previous read), which is updated with the ones that do."""
    out = {}
    for meta in sorted((root / "mutants" / "bubblefree").rglob("*.py.meta")):
        try:
            data = json.loads(meta.read_text())
            last[meta] = data
        except (OSError, ValueError):
            data = last.get(meta)
            if data is None:
                print(f"{meta}: unreadable and never read before; its mutants are left out",
                      file=sys.stderr)
                continue
        path = meta.relative_to(root / "mutants").as_posix()[: -len(".meta")]
        durations = data.get("durations_by_key", {})
        for name, code in data["exit_code_by_key"].items():
            out[name] = {"path": path, "code": code, "s": durations.get(name)}
    return out


class _Output(threading.Thread):
    """Copies mutmut's output to a log and says when a phase starts."""

    def __init__(self, stream, log: Path, started: float):
        super().__init__(daemon=True)
        self.stream, self.log, self.started = stream, log, started
        self.phases: dict[str, float] = {}
        self.last = ""

    def run(self) -> None:
        with open(self.log, "wb") as log:
            for chunk in iter(lambda: self.stream.read1(65536), b""):
                log.write(chunk)
                for piece in re.split(r"[\r\n]+", chunk.decode(errors="replace")):
                    piece = piece.strip()
                    if piece:
                        self.last = piece
                    for phase in PHASES:
                        if phase in piece and phase not in self.phases:
                            self.phases[phase] = time.monotonic() - self.started
                            print(f"[{self.phases[phase]:6.1f}s] mutmut: {phase}", flush=True)


def run(root: Path, max_children: int, only: list[str], budget_s: float | None, log: Path,
        timeout_multiplier: float | None = None) -> tuple[dict[str, dict], dict]:
    """Run mutmut afresh; stop it at ``budget_s`` seconds. Returns every
    mutant's record (``read_meta``) and what happened to the run."""
    shutil.rmtree(root / "mutants", ignore_errors=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CI="true")  # the derandomized Hypothesis profile
    started = time.monotonic()
    multiplier = "" if timeout_multiplier is None else str(timeout_multiplier)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, multiplier, "run", "--max-children",
                             str(max_children), *only], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    output = _Output(proc.stdout, log, started)
    output.start()
    last: dict[Path, dict] = {}
    stopped, said = False, started
    while proc.poll() is None:
        now = time.monotonic()
        if budget_s is not None and now - started >= budget_s:
            # The main process first: once it is gone no result is recorded,
            # so a worker killed below is never counted as a kill.
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            stopped = True
            print(f"[{now - started:6.1f}s] budget of {budget_s:.0f} s reached: mutmut stopped",
                  flush=True)
            break
        if now - said >= 60 and "Running mutation testing" in output.phases:
            print(f"[{now - started:6.1f}s] mutmut: {output.last}", flush=True)
            said = now
        read_meta(root, last)
        time.sleep(min(5.0, max(0.1, (budget_s or 1e9) - (now - started))))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # workers a finished mutmut may have left
    output.join(timeout=10)
    info = dict(wall_s=round(time.monotonic() - started, 1), stopped_at_budget=stopped,
                timeout_multiplier=timeout_multiplier,
                exit_code=None if stopped else proc.returncode,
                phases_s={k: round(v, 1) for k, v in output.phases.items()})
    return read_meta(root, last), info


def changes(root: Path, records: dict[str, dict], names: list[str]) -> dict[str, list[str]]:
    """(removed line, added line) of each named mutant, from ``mutants/``."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    out, cwd = {}, os.getcwd()
    os.chdir(root)  # mutmut reads mutants/ relative to the working directory
    try:
        for name in names:
            shown = get_diff_for_mutant(name, path=records[name]["path"]).splitlines()
            minus = " ".join(x[1:].strip() for x in shown if x.startswith("-") and not x.startswith("---"))
            plus = " ".join(x[1:].strip() for x in shown if x.startswith("+") and not x.startswith("+++"))
            out[name] = [minus, plus]
    finally:
        os.chdir(cwd)
    return out


def shard(root: Path, records: dict[str, dict], only: list[str], info: dict, max_children: int) -> dict:
    """The shard file's content: the selected mutants' results, the changes of
    those that were checked and not killed, and how the run went."""
    from mutmut.stats import status_by_exit_code

    mine = {n: dict(r, status=status_by_exit_code[r["code"]]) for n, r in records.items()
            if selected(n, only)}
    alive = sorted(n for n, r in mine.items() if r["status"] not in KILLED | UNRUN)
    totals = {p: sum(package_of(n) == p for n in records) for p in PACKAGES}
    return dict(format=FORMAT, date=datetime.date.today().isoformat(), machine=platform.machine(),
                cpus=os.cpu_count(), max_children=max_children, only=only, totals=totals, **info,
                mutants={n: {"path": r["path"], "status": r["status"], "s": r["s"]}
                         for n, r in sorted(mine.items())},
                changes=changes(root, records, alive))


def unchecked_modules(mutants: dict[str, dict]) -> dict[str, int]:
    """How many selected mutants of each module were not checked."""
    out: dict[str, int] = {}
    for name, record in mutants.items():
        if record["status"] == "not checked":
            module = module_of(name)
            out[module] = out.get(module, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def file_name(only: list[str]) -> str:
    """``mutation-<patterns>.json``, in letters, digits, '.', '_' and '-'."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", "+".join(only)).strip("_.") or "all"
    if len(label) > 80:  # many patterns: a prefix, and a hash that tells them apart
        label = label[:60] + "-" + hashlib.sha1(label.encode()).hexdigest()[:8]
    return f"mutation-{label}.json"


def load(paths: list[Path]) -> tuple[dict[str, str], dict[str, tuple[str, str]], list[dict]]:
    """Shards merged: each mutant's status (a checked one wins over "not
    checked"; a later file wins between two checked ones), the changes, and
    each shard's description (its file without the mutants)."""
    statuses: dict[str, str] = {}
    found: dict[str, tuple[str, str]] = {}
    runs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise SystemExit(f"{path}: not a mutation shard file of format {FORMAT}")
        for name, record in data["mutants"].items():
            if record["status"] != "not checked" or name not in statuses:
                statuses[name] = record["status"]
        found.update({n: tuple(c) for n, c in data["changes"].items()})
        runs.append({k: v for k, v in data.items() if k not in ("mutants", "changes")}
                    | {"file": Path(path).name, "count": len(data["mutants"]),
                       "not_checked": sum(r["status"] == "not checked" for r in data["mutants"].values())})
    return statuses, found, runs
