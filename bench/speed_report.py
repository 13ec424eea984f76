"""The speed benchmark's output: JSON lines, markdown tables, the docs entry, a plot."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
from pathlib import Path

MODES = ("pipelined", "blocking", "auto")  # auto: launch ahead or not, chosen per tick
INTRO = ("# Speed benchmarks\n\nThe engine, pipelined and blocking, on the same backend object, "
         "and plain transformers on the same workload, all measured in one run "
         "(`python -m bubblefree.bench.speed`).\n")


def notes(tokens: dict[str, int], repeats: int) -> str:
    t, d, p = tokens["text"], tokens["detect"], tokens["point"]
    timing = (f"Each mode runs {repeats} times per cell, in the order pipelined, blocking, auto "
              "and back; throughput is the median of the "
              f"{repeats - 1} run{'s' * (repeats > 2)} without the timing hook"
              + (" (of two, their mean; every mode's runs sit at the same mean position in that "
                 "order, so a steady drift over the cell moves each mode alike)" if repeats % 2 else "")
              + ", and GPU "
              "idle, F and B come from the last run, which has it" if repeats > 1 else
              "Each mode runs once per cell, with the timing hook")
    return (
        "Closed loop: each cell keeps *streams* requests in flight until its requests are done. "
        f"Prompts are 32 random token ids, greedy but in *sampled*. *text*: {t} new tokens, no stop token. "
        f"*detect*: {d} tokens constrained to a cycle of three disjoint token-id ranges (x, y, "
        f"size bins); the end is known only at commit (cap {d + 2}). *point*: {p} constrained "
        f"tokens, cap {p + 1}. *mix*: the three interleaved. *sampled* (where run): the text "
        f"drawn at temperature 0.7, top_p 0.9, the peers drawing alike. {timing}: CUDA events around each "
        "forward and each sampling on the compute stream, the gaps between them summed "
        "(*GPU idle/step*), host clocks around launch and wait. *ms/step* is wall time per "
        "launched step (prefills included); *÷ read floor* divides it by the read floor, the "
        "weight bytes ÷ the read bandwidth measured at the start of the same run (a batch-1 step "
        "reads every weight once; the KV cache and activations are left out, so the floor is a "
        "minimum). Peers submit all their requests at once (text and sampled only).")


# Each run's figures kept in its mode's row, in the order run: throughput,
# and where its steps went on the host (``speed_cells.run_closed_loop``).
RUN_FIELDS = ("tok_s", "wait_ms", "host_ms", "choose_ms", "gc_ms")


def run_order(repeats: int, turn: int = 0) -> list[tuple[int, str]]:
    """``(repeat, mode)`` in the order a cell runs them: ``MODES`` turned
    by ``turn`` (the cell's place in the grid), reversed at every odd
    repeat. The first cell runs P B A, A B P, P B A; the second B A P,
    P A B, B A P; the third A P B, B P A, A P B. In every cell each mode's
    plain runs sit at the same mean position, so a steady drift moves
    every mode alike (``mode_row``). One mode's two plain runs sit side by
    side in the middle, where one short slow stretch of the host can take
    both; that mode turns from cell to cell instead of always being auto."""
    k = turn % len(MODES)
    base = MODES[k:] + MODES[:k]
    return [(i, mode) for i in range(repeats) for mode in (base if i % 2 == 0 else base[::-1])]


def mode_row(runs: list[dict]) -> dict:
    """One mode's runs of a cell (in the order run; the timing hook's last)
    as the table's row: tok/s, req/s and ms/step the median over the runs
    without the hook (of two, their mean), the other fields from the upper
    median of them.

    Why: the modes run in ``run_order``, e.g. P B A, A B P, P B A, so with
    an even count of plain runs (an odd count of repeats, three by
    default) each mode's sit at the same mean position (1 and 6, 2 and 5,
    3 and 4), and a steady drift in the machine's speed over the cell
    moves every mode's mean alike. With four (five repeats) the middle two
    sit there too (6 and 7, 5 and 8, 4 and 9 of 1-12), and one run that
    stalls, as runs of a quarter of their neighbours' speed did at 64
    streams (sixteenth stop), moves the median by a neighbour's gap, not
    the mean by a quarter of the run. The upper median of two was the later or the
    earlier run, whichever was faster: the mode at the ends of the order
    took the most drifted run, and the mode in the middle never did."""
    plain = [r for r in runs if not r.get("hooked")] or runs
    row = dict(sorted(plain, key=lambda r: r["tok_s"])[len(plain) // 2])
    for key in ("tok_s", "req_s", "ms_step"):
        if all(key in r for r in plain):
            row[key] = statistics.median(r[key] for r in plain)
    for key in RUN_FIELDS:
        if all(key in r for r in runs):
            row[f"{key}_runs"] = [r[key] for r in runs]
    return row


def run_spans(run: dict) -> str:
    """Where one run's steps went on the host, ms a step: blocked in
    ``wait``, the host's own work (auto's choosing inside it), and the
    garbage collections of the run (ms in all)."""
    return (f"wait {run['wait_ms']:.2f}, host {run['host_ms']:.2f} of which choosing "
            f"{run['choose_ms']:.3f}; gc {run['gc_count']} in {run['gc_ms']:.1f} ms")


def behind_summary(behind) -> dict | None:
    """Medians of the auto rule's inputs over behind ticks (``core.ahead.
    Behind`` records, as ``Engine.behind`` keeps them), times in ms, and the
    zombie cost it weighed, ``forward * zombies / rows``, against the
    bubble; None where auto never blocked."""
    why = list(behind)
    if not why:
        return None
    med = statistics.median
    return dict(ticks=len(why), rows=med(b.rows for b in why), zombies=med(b.zombies for b in why),
                follow=med(b.follow for b in why), bubble_ms=1e3 * med(b.bubble for b in why),
                forward_ms=1e3 * med(b.forward for b in why),
                zombie_cost_ms=1e3 * med(b.forward * b.zombies / b.rows for b in why))


def timings_summary(engine) -> dict:
    """The auto rule's running means as the core holds them (``ahead_measures.Timings``,
    ``Successors``), in ms: the commit's host time, each step kind's launch
    call and device time, and the callers' follow share. Beside
    ``behind_summary``, it shows which step kind's cost the rule did not
    weigh."""
    t = engine.timings
    ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
    return dict(commit_ms=ms(t.commit_host),
                launch_ms={k.value: ms(v) for k, v in t.launch_hosts.items()},
                forward_ms={k.value: ms(v) for k, v in t.forwards.items()},
                follow=engine.successors.rate)


def emit(row: dict) -> None:
    """Print one cell as a JSON line; append it to $OUT/bench.jsonl when set."""
    line = json.dumps(row, default=str)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / "bench.jsonl", "a") as f:
            f.write(line + "\n")


def copy_out(*paths: str) -> None:
    """Copies of the written files into $OUT, when set (a remote run's way home)."""
    out = os.environ.get("OUT")
    for p in paths:
        if out and p and Path(p).is_file():
            dest = Path(out) / Path(p).name
            if not dest.exists() or not dest.samefile(p):
                shutil.copy(p, dest)


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def main_table(rows: list[dict], floor_ms: float | None, read_gbps: float | None) -> str:
    """One row per cell; *÷ read floor* is ms/step over ``floor_ms``, the
    weights read at ``read_gbps`` (named in its column's header)."""
    base = {(r["workload"], r["streams"]): r.get("tok_s") for r in rows if r["mode"] == "blocking"}
    named = (f" ({floor_ms:.3f} ms" + (f" at {read_gbps:,.0f} GB/s)" if read_gbps else ")")
             if floor_ms else "")
    lines = ["| workload | streams | mode | requests | tok/s | req/s | ms/step | "
             f"GPU idle/step (ms) | ÷ read floor{named} | "
             "latency p50 / p99 (ms) | ÷ blocking | note |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        head = f"| {r['workload']} | {r['streams']} | {r['mode']} |"
        if r.get("error"):
            lines.append(head + " — |" * 8 + f" {r['error']} |")
            continue
        b = base.get((r["workload"], r["streams"]))
        ratio = r["tok_s"] / b if b else None
        floor = r["ms_step"] / floor_ms if floor_ms else None
        lat = (f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}" if r.get("p50_ms") is not None else "—")
        lines.append(
            head + f" {r['requests']} | {r['tok_s']:,.0f} | {r['req_s']:,.1f} | "
            f"{r['ms_step']:.2f} | {_f(r.get('idle_ms'), '.3f')} | {_f(floor, '.2f')} | {lat} | "
            f"{_f(ratio, '.2f')} | {r.get('note', '')} |")
    return "\n".join(lines)


AUTO_TARGET = 0.98  # issue 14: the default at least this share of the better mode, in every cell


def auto_summary(rows: list[dict]) -> str:
    """One line: in how many cells auto (the per-tick choice, the default)
    reached ``AUTO_TARGET`` of the better of pipelined and blocking, and
    each cell under it; cells missing any of the three modes (an error, a
    skip) are named apart, not counted."""
    tok = {(r["workload"], r["streams"], r["mode"]): r.get("tok_s") for r in rows if not r.get("error")}
    cells = list(dict.fromkeys((r["workload"], r["streams"]) for r in rows if r["mode"] in MODES))
    ratios, incomplete = {}, []
    for cell in cells:
        p, b, a = (tok.get((*cell, m)) for m in MODES)
        if p and b and a is not None:
            ratios[cell] = a / max(p, b)
        else:
            incomplete.append(cell)
    if not ratios:
        return "auto against the better mode: no cell ran all three modes"
    hosts = {(r["workload"], r["streams"], r["mode"]): r.get("host_ms_runs")
             for r in rows if not r.get("error")}
    under = [f"{w} x{n} {x:.3f}" + _host_runs(hosts, (w, n))
             for (w, n), x in ratios.items() if x < AUTO_TARGET]
    line = (f"auto >= {AUTO_TARGET} x the better of pipelined and blocking in "
            f"{len(ratios) - len(under)} of {len(ratios)} cells"
            + (f" (under: {', '.join(under)})" if under else ""))
    if incomplete:
        line += f"; not all three modes ran in {', '.join(f'{w} x{n}' for w, n in incomplete)}"
    return line


def _host_runs(hosts: dict, cell: tuple[str, int]) -> str:
    """A cell under the line: each mode's host work, ms a step, run by
    run (the hooked run last), where the rows kept them. A slow stretch
    of the host takes every mode it falls on; these say whether it fell
    on auto's runs rather than auto choosing worse."""
    parts = [f"{m} {' '.join(f'{h:.2f}' for h in hosts[(*cell, m)])}"
             for m in MODES if hosts.get((*cell, m))]
    return f" [host ms a step by run: {'; '.join(parts)}]" if parts else ""


def seed_model(rows: list[dict], workload: str = "detect") -> tuple[str, list[dict]]:
    """The seed's model, T_block / T_pipe × (1 − z), against the measurement.

    From the blocking run: F, GPU time per step (forward + sampling), and B,
    host time per step outside ``wait`` (bookkeeping). A blocking loop runs
    them in series, T_block = F + B; a pipelined one overlaps them,
    T_pipe = max(F, B). z is the pipelined run's share of steps whose every
    row was a zombie (a wasted forward)."""
    by = {(r["streams"], r["mode"]): r for r in rows
          if r["workload"] == workload and not r.get("error")}
    lines = ["| streams | F: GPU ms/step | B: host ms/step, blocking (pipelined) | z | "
             "T_block = F + B (measured) | T_pipe = max(F, B) (measured) | "
             "predicted speedup | measured speedup |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out = []  # F is forward + sampling
    for streams in sorted({s for s, _ in by}):
        p, b = by.get((streams, "pipelined")), by.get((streams, "blocking"))
        if not p or not b:
            continue
        f_ms, b_ms, z = b.get("busy_ms"), b.get("bookkeeping_ms"), p["z"]
        measured = p["tok_s"] / b["tok_s"]
        if f_ms is not None and b_ms is not None:
            t_block, t_pipe = f_ms + b_ms, max(f_ms, b_ms)
            predicted = t_block / t_pipe * (1 - z)
        else:
            t_block = t_pipe = predicted = None
        out.append(dict(workload=workload, streams=streams, F_ms=f_ms, B_ms=b_ms,
                        B_pipelined_ms=p.get("bookkeeping_ms"), z=z, T_block_ms=t_block,
                        T_pipe_ms=t_pipe, predicted=predicted, measured=measured))
        lines.append(
            f"| {streams} | {_f(f_ms, '.3f')} | {_f(b_ms, '.3f')} "
            f"({_f(p.get('bookkeeping_ms'), '.3f')}) | {z:.4f} | "
            f"{_f(t_block, '.3f')} ({b['ms_step']:.3f}) | {_f(t_pipe, '.3f')} "
            f"({p['ms_step']:.3f}) | {_f(predicted, '.3f')} | {measured:.3f} |")
    return "\n".join(lines), out


def append_docs(path: str, header: str, body: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    old = p.read_text() if p.exists() else INTRO
    p.write_text(old.rstrip() + "\n\n" + header + "\n\n" + body + "\n")


def header(env: dict, command: str, floor: dict, notes_text: str) -> str:
    return (f"## Speed, {datetime.date.today().isoformat()}\n\n"
            f"Device: {env['device']}; torch {env['torch']}, transformers "
            f"{env['transformers']}. Command: `{command}`.\n\n"
            f"Model: {env['model']}; decode step: {env.get('decode', 'n/a')}; prefill: "
            f"{env.get('prefill', 'n/a')}; weights {floor['weight_gb']:.3f} GB; read bandwidth "
            f"{floor['read_gbps']:,.0f} GB/s ({floor['probe']}); read floor "
            f"{floor['floor_ms']:.3f} ms/step (weights ÷ read bandwidth; an untied input "
            "embedding, only gathered, is counted too).\n\n" + notes_text)


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """tokens/s against streams, a panel per workload, a line per mode or peer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as ex:  # noqa: BLE001 - the plot is optional
        return f"no plot: {ex!r}"
    good = [r for r in rows if not r.get("error")]
    workloads = list(dict.fromkeys(r["workload"] for r in good))
    if not workloads:
        return "no plot: no results"
    cols = min(2, len(workloads))
    nrows = -(-len(workloads) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    for ax, w in zip(axes.flat, workloads):
        streams = sorted({r["streams"] for r in good if r["workload"] == w})
        for mode in dict.fromkeys(r["mode"] for r in good if r["workload"] == w):
            pts = sorted((r["streams"], r["tok_s"]) for r in good
                         if r["workload"] == w and r["mode"] == mode)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(streams, [str(x) for x in streams])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(w)
        ax.set_xlabel("streams")
        ax.set_ylabel("tokens/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
