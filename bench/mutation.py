"""Mutation testing of ``core/``, of the oracle, ``fake_backend/``, and of
the serving layer (``bubblefree/loop.py``, ``engine.py``, ``handle.py``,
``streams.py``): mutmut's score per package, and every surviving mutant with
the reason it survives, written into docs/verification.md.

mutmut (configured in pyproject.toml's ``[tool.mutmut]``) copies the project
into ``mutants/``, rewrites every function of those files into variants, and
runs the fast proof subset against each: a mutant is killed when a test
fails. The tests import ``bubblefree.core`` (the ``bubblefree/`` package
reaches ``core/`` through a symlink), and mutmut keys a mutant by the import
name of its module, so the sources are configured under ``bubblefree/``;
mutmut itself stops when the tests run code under other names, and a
package with mutants but not one killed stops the report (its mutants were
not exercised). The Hypothesis tests run under the derandomized CI profile,
so a mutant's verdict does not change from run to run. A score counts what
mutmut's own score counts as killed: killed and timed out.

A survivor is either an *equivalent* mutant (no behaviour changed, so no
test can kill it) or a gap. Gaps are closed with tests; what stays is
judged in ``VERDICTS`` below, keyed by the function and the mutated line
(stable when mutmut renumbers). A survivor without a verdict is reported as
unjudged, and the run fails below a package's target (``TARGETS``).

    python -m bubblefree.bench.mutation [--max-children N] [--only PATTERN ...]
    python -m bubblefree.bench.mutation --report-only

On a machine with more CPUs, one shard a command, stopped at a budget
(``bench/mutation_shard.py``), then the shards' files merged here:

    python -m bubblefree.bench.mutation --only 'bubblefree.core*' --budget-s 510 --timeout-multiplier 1 --out DIR
    python -m bubblefree.bench.mutation --only 'bubblefree.fake_backend*' 'bubblefree.loop*' \
        'bubblefree.engine*' 'bubblefree.handle*' 'bubblefree.streams*' --budget-s 510 --timeout-multiplier 1 --out DIR
    python -m bubblefree.bench.mutation --merge DIR/mutation-*.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

from bubblefree.bench import mutation_shard as shards
from bubblefree.bench.mutation_shard import KILLED, PACKAGES, UNRUN, module_of, package_of
from bubblefree.bench.mutation_verdicts import OUTSIDE, VERDICTS

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "verification.md"
BEGIN, END = "<!-- mutation:begin -->", "<!-- mutation:end -->"
# The targets; none was set for the serving layer, whose score is reported.
TARGETS = {"core": 0.98, "fake_backend": 0.95, "serving": None}
LABELS = {"core": "core/", "fake_backend": "fake_backend/",
          "serving": "serving layer (bubblefree/loop.py, engine.py, handle.py, streams.py)"}
SHOWN = 25  # survivors a shard prints when it ends (its file has them all)


def where(name: str) -> str:
    """The mutated function, by its file in the repository:
    ``bubblefree.core.scheduler.xǁSchedulerǁcommit__mutmut_12`` -> ``core/scheduler.py: Scheduler.commit``;
    ``bubblefree.core.pages.x_pages_needed__mutmut_3`` -> ``core/pages.py: pages_needed``;
    ``bubblefree.loop.xǁServingLoopǁ_take__mutmut_1`` -> ``bubblefree/loop.py: ServingLoop._take``."""
    module = module_of(name)
    func = re.sub(r"__mutmut_\d+$", "", name[len(module) + 1:])
    func = func[1:].strip("ǁ").replace("ǁ", ".") if func.startswith("xǁ") else func[2:]
    parts = module.split(".")
    if package_of(name) in ("core", "fake_backend"):  # folders at the top, linked into bubblefree/
        parts = parts[1:]
    return f"{'/'.join(parts)}.py: {func}"


def scores(statuses: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Per package: (killed, judged)."""
    out = {}
    for package in PACKAGES:
        judged = [s for n, s in statuses.items() if package_of(n) == package and s not in UNRUN]
        out[package] = (sum(s in KILLED for s in judged), len(judged))
    return out


def verdict(name: str, status: str, plus: str) -> str | None:
    """Why a survivor survives: an equivalent mutant's verdict, or, for one
    no test of the subset reaches, why the subset leaves its function out."""
    found = VERDICTS.get((where(name), plus))
    if found is None and status == "no tests":
        found = OUTSIDE.get(where(name))
    return found


def _score_line(package: str, killed: int, judged: int) -> str:
    if not judged:
        return f"**{LABELS[package]}: not run.**"
    target = TARGETS[package]
    return (f"**{LABELS[package]}: {killed} / {judged} killed = {killed / judged:.1%}** "
            + (f"(target {target:.0%})." if target is not None else "(no target set)."))


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'s' * (n != 1)}"


def describe(runs: list[dict], only: list[str]) -> str:
    """The report's first lines: where and how the results were made."""
    tool = "mutmut over `core/`, `fake_backend/` and the serving layer, test subset in `pyproject.toml`"
    first = runs[0] if runs else {}
    when = first.get("date", datetime.date.today().isoformat())
    machine = f"{first.get('machine', platform.machine())} ({first.get('cpus', os.cpu_count())} CPUs)"
    merged = bool(runs) and "file" in first  # else this run, or results left in mutants/
    if merged:
        line = (f"Run {when} on {machine}, `python -m bubblefree.bench.mutation` ({tool}), "
                f"{_count(len(runs), 'shard')} of {_count(first['max_children'], 'worker')} merged with `--merge`")
    else:
        line = f"Run {when} on {machine}, `make mutation` (`python -m bubblefree.bench.mutation`, {tool})"
        if first.get("stopped_at_budget"):
            line += f", stopped at its budget after {first['wall_s']:,.0f} s"
    if first.get("timeout_multiplier"):
        line += (f"; a mutant timed out after {first['timeout_multiplier']:g} × (its tests' time in "
                 f"mutmut's stats run + {shards.TIMEOUT_CONSTANT_S:g} s)")
    line += f", only the mutants matching {', '.join(f'`{o}`' for o in only)}." if only else "."
    if merged:
        parts = []
        for r in runs:
            part = f"{', '.join(f'`{o}`' for o in r['only']) or 'all'} ({_count(r['count'], 'mutant')}, {r['wall_s']:,.0f} s"
            if r["stopped_at_budget"]:
                part += f", stopped at its budget with {r['not_checked']:,} not checked"
            parts.append(part + ")")
        line += " Shards: " + "; ".join(parts) + "."
    return line


def report(statuses: dict[str, str], only: list[str], change, runs: list[dict] | None = None,
           complete: bool | None = None) -> tuple[str, bool, int]:
    """The docs section; whether every target is met by a complete run; how
    many survivors have no verdict. ``change(name)`` gives a survivor's
    (removed line, added line)."""
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    per = scores(statuses)
    for package, (killed, judged) in per.items():
        if judged and not killed:
            raise SystemExit(f"{package}: {judged} mutants and none killed: the tests did not import them")
    unchecked = counts.get("not checked", 0)
    if complete is None:
        complete = not only
    complete = complete and not unchecked
    ok = all(k >= TARGETS[p] * j for p, (k, j) in per.items() if j and TARGETS[p] is not None) and complete
    survivors = sorted(n for n, s in statuses.items() if s not in KILLED | UNRUN)
    rows, unjudged = [], 0
    for name in survivors:
        minus, plus = change(name)
        why = verdict(name, statuses[name], plus)
        if why is None:
            unjudged += 1
            why = "**not judged yet**"
        rows.append(f"| `{where(name)}` | `{minus}` → `{plus}` | {statuses[name]} | {why} |")
    lines = [
        describe(runs or [], only),
        "",
        *(_score_line(p, k, j) for p, (k, j) in per.items()),
        *([f"{unchecked:,} mutants were not checked (cut off by a budget, or not selected): the "
           "scores are of those checked."] if unchecked else []),
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


def merged(paths: list[Path]) -> tuple[str, bool, int]:
    """The report from shards' files (``--merge``)."""
    statuses, found, runs = shards.load(paths)
    only = sorted({o for r in runs for o in r["only"]}) if all(r["only"] for r in runs) else []
    # A file from before a package was configured has no total for it.
    totals = {p: max(r["totals"].get(p, 0) for r in runs) for p in PACKAGES}
    complete = all(sum(package_of(n) == p for n in statuses) == totals[p] for p in PACKAGES)
    return report(statuses, [] if complete else only, lambda n: found[n], runs, complete)


def summary(data: dict) -> str:
    """A shard's counts and cost, printed when it ends."""
    mutants, left = data["mutants"], shards.unchecked_modules(data["mutants"])
    counts: dict[str, int] = {}
    for record in mutants.values():
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    done = sorted(r["s"] for r in mutants.values() if r["s"] is not None and r["status"] not in UNRUN)
    per = scores({n: r["status"] for n, r in mutants.items()})
    cost = (f"; per mutant (one worker) median {done[len(done) // 2]:.1f} s, max {done[-1]:.1f} s, "
            f"{sum(done):,.0f} s in all" if done else "")
    return (f"{len(mutants):,} mutants selected in {data['wall_s']:,.0f} s with {data['max_children']} "
            f"worker{'s' * (data['max_children'] > 1)}"
            f"{' (stopped at the budget)' if data['stopped_at_budget'] else ''}; phases began at "
            + ", ".join(f"{k} {v:.0f} s" for k, v in data["phases_s"].items()) + f"{cost}.\n"
            + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + ". "
            + " ".join(f"{LABELS[p]}: {k} / {j} killed." for p, (k, j) in per.items() if j)
            + "".join(f"\n  {mutants[n]['status']}: {where(n)}: `{minus}` → `{plus}`"
                      for n, (minus, plus) in sorted(data["changes"].items())[:SHOWN])
            + (f"\n  ... {len(data['changes']) - SHOWN} more in the file" if len(data["changes"]) > SHOWN else "")
            + (f"\nnot checked, by module: {', '.join(f'{m} {n}' for m, n in left.items())}; to check them: "
               f"--only {' '.join(repr(m + '*') for m in left)}" if left else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="reuse the results in mutants/")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--only", nargs="*", default=[], metavar="PATTERN",
                        help="run only the mutants whose names match (mutmut's wildcards); reported as such")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="stop mutmut after S seconds of wall time, keeping every finished mutant")
    parser.add_argument("--timeout-multiplier", type=float, default=None, metavar="X",
                        help="a mutant times out after X × (its tests' time in mutmut's stats run + "
                             f"{shards.TIMEOUT_CONSTANT_S:g} s) (default: mutmut's, 15 × (that + 1 s))")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write this run's results to DIR/mutation-<patterns>.json (and mutmut's "
                             "output to DIR/mutmut.log) instead of docs/verification.md")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="FILE",
                        help="write docs/verification.md from shards' result files; runs nothing")
    args = parser.parse_args(argv)
    if args.merge:
        section, ok, unjudged = merged(args.merge)
    else:
        if args.report_only:
            records, info, runs = shards.read_meta(ROOT, {}), shards.NO_RUN, []
        else:
            log = (args.out or ROOT / "mutants") / "mutmut.log"
            records, info = shards.run(ROOT, args.max_children, args.only, args.budget_s, log,
                                       args.timeout_multiplier)
            if info["exit_code"]:
                tail = [x for x in re.split(r"[\r\n]+", log.read_text(errors="replace")) if x.strip()]
                print("\n".join(tail[-40:]), file=sys.stderr)
                print(f"mutmut exited with status {info['exit_code']} (its output: {log})", file=sys.stderr)
                if not args.out:
                    return 2
            runs = [dict(date=datetime.date.today().isoformat(), machine=platform.machine(),
                         cpus=os.cpu_count(), **info)]
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            data = shards.shard(ROOT, records, args.only, info, args.max_children)
            path = args.out / shards.file_name(args.only)
            path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
            print(summary(data))
            print(f"results of {len(data['mutants']):,} mutants written to {path}")
            return 2 if info["exit_code"] else 0
        from mutmut.stats import status_by_exit_code

        statuses = {n: status_by_exit_code[r["code"]] for n, r in records.items()}
        found = shards.changes(ROOT, records, sorted(n for n, s in statuses.items() if s not in KILLED | UNRUN))
        section, ok, unjudged = report(statuses, args.only, lambda n: tuple(found[n]), runs)
    write_doc(section)
    print(section)
    if unjudged:
        print(f"{unjudged} surviving mutants are not judged in bench/mutation_verdicts.py", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
