"""``bench.step_gaps``: forwards found as runs of the decode step's kernels,
and what ran between consecutive ones, on a trace written out by hand."""

from __future__ import annotations

from bubblefree.bench.step_gaps import between_forwards, format_report


def kernel(name, ts, dur, cat="kernel", tid=7):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def forward(t0, n=3):
    """``n`` forward kernels 10 us apart, 8 us each: spans ``10 * n - 2`` us."""
    return [kernel("_gemm_kernel" if i % 2 else "split_kernel", t0 + 10 * i, 8) for i in range(n)]


def test_gaps_are_measured_between_consecutive_forwards_and_list_what_ran():
    trace = (forward(0) + [kernel("argmax", 30, 5), kernel("Memcpy DtoH", 36, 2, "gpu_memcpy", 9)]
             + forward(40)  # 12 us after the first ended at 28
             + [kernel("cpu thing", 41, 1, cat="cpu_op")]  # not a device event
             + [kernel("encoder", 200, 900)]
             + forward(5000)  # far after: another phase, no gap counted
             + [kernel("copy", 5050, 1)]
             + forward(5100, n=2))  # too short a run: not a forward
    r = between_forwards(trace, min_run=3, max_gap_us=1000)
    assert r.forwards == 3
    assert r.forward_us == [28, 28, 28]
    assert len(r.gaps) == 1
    gap, ops = r.gaps[0]
    assert gap == 12
    assert [(o.name, o.start, o.dur, o.stream) for o in ops] == \
        [("argmax", 2, 5, "7"), ("Memcpy DtoH", 8, 2, "9")]
    text = format_report(r)
    assert "median 12.0 us" in text and "argmax" in text


def test_a_trace_without_two_close_forwards_says_so():
    assert "no two within" in format_report(between_forwards(forward(0, 30), min_run=20))


def test_a_copy_on_another_stream_during_a_forward_does_not_cut_it():
    """A step's next metadata copied in beside a forward (another stream)
    is not one of the forward's kernels, and the forward stays one run."""
    trace = (forward(0) + [kernel("Memcpy HtoD", 12, 1, "gpu_memcpy", 9)]
             + [kernel("_greedy_kernel", 30, 5)] + forward(40))
    r = between_forwards(trace, min_run=3, max_gap_us=1000)
    assert r.forwards == 2 and r.forward_us == [28, 28]
    gap, ops = r.gaps[0]
    assert gap == 12 and [(o.name, o.start) for o in ops] == [("_greedy_kernel", 2)]
