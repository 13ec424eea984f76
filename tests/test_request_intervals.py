"""``bench.request_intervals``: a run's compute-stream intervals summed up
per step, on intervals written out by hand (the run itself needs a GPU)."""

from __future__ import annotations

import pytest

from bubblefree.bench import request_intervals


def test_the_summary_splits_a_step_into_forward_sampling_gaps_and_the_prefills_share():
    # Two requests: a prefill of 1.4 ms, then decode forwards of 0.85 and
    # 0.86 ms, each followed by a sampling; 4 steps, gaps of 0.003 each.
    spans = [1.4, 0.008, 0.85, 0.009, 0.86, 0.008, 1.3, 0.008]
    s = request_intervals.summary(spans, [0.003] * 7, steps=4, prefills=2)
    assert s["decode_ms"] == pytest.approx(0.855)  # the median of the forwards but the prefills
    assert s["sampling_ms"] == pytest.approx(0.008)
    assert s["gaps_ms"] == pytest.approx(0.021 / 4)
    assert s["prefill_ms"] == [1.4, 1.3]  # the two longest forwards
    assert s["prefill_share_ms"] == pytest.approx((1.4 + 1.3 - 2 * 0.855) / 4)


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    # No GPU, whatever this machine has: the check runs before anything is built.
    monkeypatch.setattr(request_intervals.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        request_intervals.main(["--model", "llama1b"])
    assert "needs a GPU" in capsys.readouterr().err
