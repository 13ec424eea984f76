"""What the device runs between two decode forwards, from a profiler trace.

A decode step replays its forward (a graph of our Triton kernels), then the
step's sampling, copies and the next step's inputs; whatever runs between
two forwards, and any idle time there, is what a step costs beyond its
graph. ``between_forwards`` finds the forwards in a trace's device events
(runs of at least ``min_run`` kernels named in ``FORWARD``) and reports,
for consecutive forwards less than ``max_gap_us`` apart (a decode phase,
not across an image prefill), the gap and what ran in it.

    report = between_forwards(json.load(open(trace))["traceEvents"])
    print(format_report(report))

or ``profiled(run)``: ``run()`` under torch's profiler, then the same.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import tempfile

import attrs

# The decode step's kernels (pdl_step, fused_decode): a forward is a run of these.
FORWARD = frozenset({"_gemm_kernel", "split_kernel", "combine_kernel", "_add_norm_kernel",
                     "one_pass_kernel", "_reduce_kernel", "_normed_gemv_kernel", "_gemv_kernel"})
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


@attrs.frozen
class Op:
    name: str
    start: float  # us after the forward before it ended
    dur: float  # us
    stream: str


@attrs.frozen
class Report:
    forwards: int
    forward_us: list[float]  # span of each forward counted
    gaps: list[tuple[float, tuple[Op, ...]]]  # (gap us, what ran in it), consecutive forwards


def device_events(trace: list[dict]) -> list[dict]:
    return sorted((e for e in trace if e.get("cat") in DEVICE and "dur" in e),
                  key=lambda e: e["ts"])


def forwards(events: list[dict], min_run: int) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` of runs of at least ``min_run`` forward kernels."""
    runs, i = [], 0
    while i < len(events):
        if events[i]["name"] not in FORWARD:
            i += 1
            continue
        j = i
        while j < len(events) and events[j]["name"] in FORWARD:
            j += 1
        if j - i >= min_run:
            runs.append((i, j))
        i = j
    return runs


def between_forwards(trace: list[dict], min_run: int = 20, max_gap_us: float = 2000.0) -> Report:
    """Forwards are runs on the streams the forward's kernels run on: a copy
    on another stream that runs during a forward does not cut it in two.
    What ran between two forwards is every device event, on any stream,
    that started after the first's last kernel did and before the second."""
    events = device_events(trace)
    streams = {e.get("tid") for e in events if e["name"] in FORWARD}
    own = [e for e in events if e.get("tid") in streams]
    runs = forwards(own, min_run)
    spans = [(own[i]["ts"], max(e["ts"] + e["dur"] for e in own[i:j])) for i, j in runs]
    gaps = []
    for (_, j0), (_, end0), (start1, _) in zip(runs, spans, spans[1:]):
        if start1 - end0 > max_gap_us:
            continue
        after = own[j0 - 1]
        ops = tuple(Op(e["name"], e["ts"] - end0, e["dur"], str(e.get("tid", "")))
                    for e in events if after["ts"] <= e["ts"] < start1 and e is not after)
        gaps.append((start1 - end0, ops))
    return Report(forwards=len(runs), forward_us=[b - a for a, b in spans], gaps=gaps)


def format_report(r: Report, name_width: int = 60) -> str:
    if not r.gaps:
        return f"{r.forwards} forwards found, no two within the gap limit"
    gaps = sorted(r.gaps, key=lambda g: g[0])
    median_gap, median_ops = gaps[len(gaps) // 2]
    counts: dict[str, list[float]] = collections.defaultdict(list)
    for _, ops in r.gaps:
        for op in ops:
            counts[op.name].append(op.dur)
    lines = [f"forwards: {r.forwards}, span median {statistics.median(r.forward_us):.1f} us; "
             f"gaps between consecutive forwards: {len(r.gaps)}, median {median_gap:.1f} us, "
             f"mean {statistics.mean(g for g, _ in r.gaps):.1f} us",
             "ops between forwards, per gap: count, mean us each, name"]
    for name, durs in sorted(counts.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {len(durs) / len(r.gaps):5.2f}  {statistics.mean(durs):7.2f}  "
                     f"{name[:name_width]}")
    lines.append(f"the median gap ({median_gap:.1f} us), op by op: start after the forward, us, stream, name")
    for op in median_ops:
        lines.append(f"  {op.start:8.1f}  {op.dur:7.2f}  {op.stream:>10}  {op.name[:name_width]}")
    return "\n".join(lines)


def profiled(run, activities=None) -> Report:
    """``between_forwards`` over the trace of ``run()`` under torch's
    profiler (``activities``: the device's alone by default; recording the
    host's calls too slows the host that launches each step)."""
    import torch  # the trace parsing above needs no torch
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return between_forwards(json.load(f)["traceEvents"])
    finally:
        os.unlink(path)
