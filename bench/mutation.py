"""Mutation testing of ``core/``: mutmut's score, and every surviving mutant
with the reason it survives, written into docs/verification.md.

mutmut (configured in pyproject.toml's ``[tool.mutmut]``) copies the project
into ``mutants/``, rewrites every function of ``core/`` into variants, and
runs the fast proof subset against each: a mutant is killed when a test
fails. The Hypothesis tests run under the derandomized CI profile, so a
mutant's verdict does not change from run to run.

A survivor is either an *equivalent* mutant (no behaviour changed, so no
test can kill it) or a gap. Gaps are closed with tests; what stays is
judged in ``VERDICTS`` below, keyed by the function and the mutated line
(stable when mutmut renumbers). A survivor without a verdict is reported as
unjudged, and the run fails below ``TARGET``.

    python -m bubblefree.bench.mutation [--report-only] [--max-children N]
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
TARGET = 0.90
KILLED = {"killed", "timeout", "caught by type check", "segfault"}


def run_mutmut(max_children: int) -> None:
    subprocess.run(["rm", "-rf", str(ROOT / "mutants")], check=True)
    env = dict(os.environ, CI="true")  # the derandomized Hypothesis profile
    subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)],
                   cwd=ROOT, env=env, check=True)


def results() -> dict[str, str]:
    """Every mutant's status, from the ``.meta`` files mutmut leaves."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for meta in sorted((ROOT / "mutants" / "core").glob("*.py.meta")):
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
    """``core.scheduler.xǁSchedulerǁcommit__mutmut_12`` -> ``scheduler.py: Scheduler.commit``;
    ``core.pages.x_pages_needed__mutmut_3`` -> ``pages.py: pages_needed``."""
    module, _, rest = name.partition(".x")
    func = re.sub(r"__mutmut_\d+$", "", rest)
    func = func.strip("ǁ").replace("ǁ", ".") if "ǁ" in func else func[1:]
    return f"{module.split('.')[-1]}.py: {func}"


def report(statuses: dict[str, str]) -> tuple[str, float, int]:
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    judged = [s for s in statuses.values() if s not in ("not checked", "skipped")]
    killed = sum(s in KILLED for s in judged)
    score = killed / len(judged) if judged else 0.0
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
        f"(`python -m bubblefree.bench.mutation`, mutmut over `core/`, test subset in `pyproject.toml`).",
        "",
        f"**Score: {killed} / {len(judged)} killed = {score:.1%}** (target {TARGET:.0%}). "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ".",
        "",
        f"Surviving mutants ({len(survivors)}), each judged:",
        "",
        "| where | change | status | why it survives |",
        "|---|---|---|---|",
        *rows,
    ]
    return "\n".join(lines), score, unjudged


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
    args = parser.parse_args(argv)
    if not args.report_only:
        run_mutmut(args.max_children)
    section, score, unjudged = report(results())
    write_doc(section)
    print(section)
    if unjudged:
        print(f"{unjudged} surviving mutants are not judged in bench/mutation_verdicts.py", file=sys.stderr)
    return 0 if score >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
