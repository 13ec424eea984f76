"""``bench.step_increments``: each kernel's increment (how much later it
ends than the kernel before), the layers found from the attention kernels
and the final norm, on traces
written out by hand."""

from __future__ import annotations

import pytest

from bubblefree.bench.step_increments import increments, layout, main, one_step, table


def kernel(name, ts, dur, grid=(1, 1, 1), cat="kernel"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def step(t0, layers=2):
    """An inputs kernel, ``layers`` layers of (norm, GEMM, attention),
    each starting 1 us before the one before ends (dependent launches),
    then the final norm and the head."""
    names = (["_inputs_kernel"] + ["_add_norm_kernel", "_gemm_kernel", "split_kernel"] * layers
             + ["_add_norm_kernel", "_gemm_kernel"])
    out, t = [], t0
    for i, name in enumerate(names):
        dur = 5 if name == "_gemm_kernel" else 3
        out.append(kernel(name, t, dur, grid=(i, 1, 1)))
        t += dur - 1
    return out


def test_increments_are_the_ends_one_after_another_and_sum_to_the_span():
    trace = step(1000) + step(0) + step(2000) + [kernel("Memcpy", 500, 9, cat="gpu_memcpy")]
    s = one_step(trace, 3)
    assert [k.grid[0] for k in s] == list(range(9))
    assert s[0].start == 1000  # the middle replay
    inc = increments(s)
    assert inc == [3, 2, 4, 2, 2, 4, 2, 2, 4]  # each starts 1 us before the previous ends
    assert sum(inc) == s[-1].end - s[0].start
    assert layout(s, 2) == (1, 3)
    text = table(s, 2)
    assert "| layer, kernel 2 | _gemm_kernel | 5x1x1 | 5.0 | 4.0 | 8 |" in text
    assert "| after the layers | _gemm_kernel | 8x1x1 | 5.0 | 4.0 | 4 |" in text
    assert "| before the layers | _inputs_kernel" in text
    assert "span 25.0 us; layers 16.0 us (8.0 a layer); 9 kernels" in text


def test_layers_without_norm_kernels_are_found_from_attention_and_the_final_norm():
    """The norms inside the GEMMs (``KernelConfig.norm_in_gemm``): a layer is
    (GEMM, attention, GEMM), and the only norm is the final one."""
    names = (["_inputs_kernel"] + ["_gemm_kernel", "split_kernel", "combine_kernel"] * 3
             + ["_add_norm_kernel", "_gemm_kernel"])
    trace = [kernel(name, 10 * i, 3, grid=(i, 1, 1)) for i, name in enumerate(names)]
    s = one_step(trace, 1)
    assert layout(s, 3) == (1, 3)
    assert "| layer, kernel 2 | split_kernel |" in table(s, 3)
    with pytest.raises(RuntimeError, match="3 attention kernels and 1 norm kernels for 2"):
        layout(s, 2)


def test_a_trace_that_is_not_whole_steps_or_layers_says_so():
    with pytest.raises(RuntimeError, match="kernels in 2 replays"):
        one_step(step(0)[:-1] + step(100), 2)
    with pytest.raises(RuntimeError, match="2 attention kernels and 3 norm kernels for 3 layers"):
        layout(one_step(step(0), 1), 3)
    uneven = step(0)
    uneven.insert(5, kernel("_gemm_kernel", 14, 1))  # the second layer runs a kernel more
    with pytest.raises(RuntimeError, match="do not run the same kernels"):
        layout(one_step(uneven, 1), 2)


@pytest.mark.parametrize("argv,says", [(["--rows", "3"], "--rows must be a decode bucket"),
                                       (["--rows", "0"], "--rows must be a decode bucket"),
                                       (["--context", "0"], "--context must be at least 1")])
def test_bad_arguments_are_named_before_anything_is_built(argv, says, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert says in capsys.readouterr().err
