"""Mutation testing of ``core/`` and of the oracle, ``fake_backend/``:
mutmut's score per package, and every surviving mutant with the reason it
survives, written into docs/verification.md.

mutmut (configured in pyproject.toml's ``[tool.mutmut]``) copies the project
into ``mutants/``, rewrites every function of ``core/`` and ``fake_backend/``
into variants, and runs the fast proof subset against each: a mutant is
killed when a test fails. The tests import ``bubblefree.core`` (the
``bubblefree/`` package reaches ``core/`` through a symlink), and mutmut keys
a mutant by the import name of its module, so the sources are configured
under ``bubblefree/``; mutmut itself stops when the tests run code under
other names, and a package with mutants but not one killed stops the report
(its mutants were not exercised). The Hypothesis tests run under the derandomized CI profile, so a
mutant's verdict does not change from run to run.

A survivor is either an *equivalent* mutant (no behaviour changed, so no
test can kill it) or a gap. Gaps are closed with tests; what stays is
judged in ``VERDICTS`` below, keyed by the function and the mutated line
(stable when mutmut renumbers). A survivor without a verdict is reported as
unjudged, and the run fails below a package's target (``TARGETS``).

    python -m bubblefree.bench.mutation [--report-only] [--max-children N] [--only PATTERN ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from bubblefree.bench.mutation_verdicts import VERDICTS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "verification.md"
BEGIN, END = "<!-- mutation:begin -->", "<!-- mutation:end -->"
PACKAGES = ("core", "fake_backend")  # under mutants/bubblefree/
TARGETS = {"core": 0.98, "fake_backend": 0.95}
KILLED = {"killed", "timeout", "caught by type check", "segfault"}


def run_mutmut(max_children: int, only: list[str]) -> None:
    subprocess.run(["rm", "-rf", str(ROOT / "mutants")], check=True)
    env = dict(os.environ, CI="true")  # the derandomized Hypothesis profile
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children), *only],
                   cwd=ROOT, env=env, check=True)


def results() -> dict[str, str]:
    """Every mutant's status, from the ``.meta`` files mutmut leaves."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for meta in sorted(m for name in PACKAGES for m in (ROOT / "mutants" / "bubblefree" / name).glob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = status_by_exit_code[code]
    return out


def change(name: str) -> tuple[str, str]:
    """(removed line, added line) of a mutant, from ``mutmut show``."""
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    minus = " ".join(x[1:].strip() for x in shown if x.startswith("-") and not x.startswith("---"))
    plus = " ".join(x[1:].strip() for x in shown if x.startswith("+") and not x.startswith("+++"))
    return minus, plus


def where(name: str) -> str:
    """``bubblefree.core.scheduler.xǁSchedulerǁcommit__mutmut_12`` -> ``core/scheduler.py: Scheduler.commit``;
    ``bubblefree.core.pages.x_pages_needed__mutmut_3`` -> ``core/pages.py: pages_needed``."""
    module, _, rest = name.partition(".x")
    func = re.sub(r"__mutmut_\d+$", "", rest)
    func = func.strip("ǁ").replace("ǁ", ".") if "ǁ" in func else func[1:]
    return f"{'/'.join(module.split('.')[1:])}.py: {func}"


def scores(statuses: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Per package: (killed, judged)."""
    out = {}
    for package in PACKAGES:
        judged = [s for n, s in statuses.items()
                  if n.startswith(f"bubblefree.{package}.") and s not in ("not checked", "skipped")]
        out[package] = (sum(s in KILLED for s in judged), len(judged))
    return out


def report(statuses: dict[str, str], only: list[str]) -> tuple[str, bool, int]:
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    per = scores(statuses)
    for package, (killed, judged) in per.items():
        if judged and not killed:
            raise SystemExit(f"{package}: {judged} mutants and none killed: the tests did not import them")
    ok = all(k >= TARGETS[p] * j for p, (k, j) in per.items() if j) and not only
    survivors = sorted(n for n, s in statuses.items() if s not in KILLED and s not in ("not checked", "skipped"))
    rows, unjudged = [], 0
    for name in survivors:
        minus, plus = change(name)
        verdict = VERDICTS.get((where(name), plus))
        if verdict is None:
            unjudged += 1
            verdict = "**not judged yet**"
        rows.append(f"| `{where(name)}` | `{minus}` → `{plus}` | {statuses[name]} | {verdict} |")
    when = datetime.date.today().isoformat()
    lines = [
        f"Run {when} on {platform.machine()} ({os.cpu_count()} CPUs), `make mutation` "
        f"(`python -m bubblefree.bench.mutation`, mutmut over `core/` and `fake_backend/`, "
        f"test subset in `pyproject.toml`)"
        + (f", only the mutants matching {', '.join(f'`{o}`' for o in only)}." if only else "."),
        "",
        *(f"**{p}/: {k} / {j} killed = {k / j:.1%}** (target {TARGETS[p]:.0%})." if j else
          f"**{p}/: not run.**" for p, (k, j) in per.items()),
        "",
        "All statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ".",
        "",
        f"Surviving mutants ({len(survivors)}), each judged:",
        "",
        "| where | change | status | why it survives |",
        "|---|---|---|---|",
        *rows,
    ]
    return "\n".join(lines), ok, unjudged


def write_doc(section: str) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC} lacks the {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{BEGIN}\n{section}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="reuse the results in mutants/")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--only", nargs="*", default=[], metavar="PATTERN",
                        help="run only the mutants whose names match (mutmut's wildcards); reported as such")
    args = parser.parse_args(argv)
    if not args.report_only:
        run_mutmut(args.max_children, args.only)
    section, ok, unjudged = report(results(), args.only)
    write_doc(section)
    print(section)
    if unjudged:
        print(f"{unjudged} surviving mutants are not judged in bench/mutation_verdicts.py", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
