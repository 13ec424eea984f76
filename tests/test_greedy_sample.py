"""Greedy sampling in one kernel (``cuda_backend.greedy_sample``): the
masked argmax, the lowest id on ties, token 0 when nothing is allowed, and
the token written where the torch path writes it (the slot's ``sampled``,
``last_token`` at the row slot, a subclass's flags cleared there). The
torch path is checked on the CPU against the definition written out; the
kernel against the torch path on the GPU, in graphs and out. Sampling
ahead the same way: unmasked, into the row of ``sampled`` the device's
slot index names, what it overwrote kept in ``undo``."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bubblefree.cuda_backend import normed_gemv, pdl
from bubblefree.cuda_backend.graphs import GraphSet
from bubblefree.cuda_backend.greedy_sample import BLOCK, make_sampler, torch_ahead, torch_greedy
from bubblefree.cuda_backend.kernel_config import KernelConfig
from bubblefree.cuda_backend.sampling import PARTS

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a Triton kernel")
INF = float("inf")


def by_definition(row: list[float], allowed: list[bool]) -> int:
    """The lowest id among the best allowed logits; 0 when none is above -inf."""
    best, at = -INF, 0
    for i, (x, ok) in enumerate(zip(row, allowed)):
        if ok and x > best:
            best, at = x, i
    return at


def inputs_for(row_slots: list[int], mask_ids: list[int], b: int) -> torch.Tensor:
    """``pack_sampling``'s first two parts for bucket ``b`` (the rest unused here)."""
    inputs = torch.zeros(PARTS * b, dtype=torch.long)
    inputs[:b] = torch.tensor(row_slots)
    inputs[b:2 * b] = torch.tensor(mask_ids)
    return inputs


logit = st.one_of(st.sampled_from([-INF, 0.0, 1.0, 1.0, -2.5]),
                  st.floats(-30, 30, allow_nan=False, width=32))


@settings(max_examples=60)
@given(data=st.data(), v=st.integers(1, 40), b=st.integers(1, 5))
def test_the_torch_path_is_the_masked_argmax_by_definition(data, v, b):
    rows = data.draw(st.lists(st.lists(logit, min_size=v, max_size=v), min_size=b, max_size=b))
    table = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=v, max_size=v),
                                            min_size=1, max_size=4)))
    mask_ids = data.draw(st.lists(st.integers(0, table.shape[0] - 1), min_size=b, max_size=b))
    seqs = 6
    row_slots = data.draw(st.lists(st.integers(0, seqs - 1), min_size=b, max_size=b, unique=True))
    sampled, last = torch.full((b,), -1), torch.full((seqs,), -1)
    flags = torch.ones(seqs, dtype=torch.bool)
    torch_greedy(torch.tensor(rows), table, inputs_for(row_slots, mask_ids, b), b, sampled, last,
                 flags)
    want = [by_definition(r, table[m].tolist()) for r, m in zip(rows, mask_ids)]
    assert sampled.tolist() == want
    assert [last[s].item() for s in row_slots] == want
    untouched = [s for s in range(seqs) if s not in row_slots]
    assert all(last[s].item() == -1 and flags[s].item() for s in untouched)
    assert not any(flags[s].item() for s in row_slots)


@settings(max_examples=60)
@given(data=st.data(), v=st.integers(1, 40), b=st.integers(1, 5), at=st.integers(0, 1),
       bf16=st.booleans())
def test_sampling_ahead_in_torch_is_the_argmax_into_its_slot_with_what_it_overwrote_kept(
        data, v, b, at, bf16):
    rows = data.draw(st.lists(st.lists(logit, min_size=v, max_size=v), min_size=b, max_size=b))
    seqs, r = 6, 5
    row_slots = data.draw(st.lists(st.integers(0, seqs - 1), min_size=b, max_size=b, unique=True))
    logits = torch.tensor(rows).to(torch.bfloat16 if bf16 else torch.float32)
    last = torch.tensor(data.draw(st.lists(st.integers(0, 99), min_size=seqs, max_size=seqs)))
    flags = torch.tensor(data.draw(st.lists(st.booleans(), min_size=seqs, max_size=seqs)))
    before_last, before_flags = last.clone(), flags.clone()
    sampled, undo = torch.full((2, r), -1), torch.full((2, 2 * r), -1)
    torch_ahead(logits, torch.tensor(row_slots), torch.tensor([at]), sampled, undo, last, flags)
    # bfloat16 orders as its float32 values do: the definition on those
    want = [by_definition(x, [True] * v) for x in logits.float().tolist()]
    assert sampled[at, :b].tolist() == want
    assert (sampled[at, b:] == -1).all() and (sampled[1 - at] == -1).all()
    assert [last[s].item() for s in row_slots] == want
    assert not any(flags[s].item() for s in row_slots)
    assert undo[at, :b].tolist() == [before_last[s].item() for s in row_slots]
    assert undo[at, r:r + b].tolist() == [int(before_flags[s]) for s in row_slots]
    untouched = [s for s in range(seqs) if s not in row_slots]
    assert all(last[s] == before_last[s] and flags[s] == before_flags[s] for s in untouched)


def test_the_kernel_is_chosen_on_cuda_only_and_the_config_says_when_it_is_off():
    assert make_sampler(4, 100, torch.device("cpu")) is None
    assert "greedy sampling in torch" in str(attrs.evolve(KernelConfig(), greedy_kernel=False))
    assert "greedy" not in str(KernelConfig())


# -- the kernel, on the GPU -------------------------------------------------------------------


def gpu_case(v: int, b: int, seed: int):
    """Logits with ties inside a chunk and across chunks, a row of -inf,
    masks that forbid the best and one that forbids everything."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b + 2, v, generator=g)  # more rows than the bucket: the stride matters
    logits[0, v // 3] = logits[0, v - 1] = 99.0  # a tie across chunks: the lower id wins
    if b > 1:
        logits[1, :] = -INF
    if b > 2:
        logits[2, 5 % v] = logits[2, 6 % v] = 50.0
    table = torch.rand(5, v, generator=g) > 0.3
    table[0] = True
    table[3] = False
    table[4] = True
    table[4, logits[: b].argmax(-1)] = False  # forbids each row's best
    mask_ids = [int(i) for i in torch.randint(0, 5, (b,), generator=g)]
    mask_ids[0] = 0
    seqs = 2 * b + 3
    row_slots = [int(i) for i in torch.randperm(seqs - 1, generator=g)[:b]]
    if b > 3:
        row_slots[-1] = row_slots[-2] = seqs - 1  # padded rows share the scratch row
    return logits, table, inputs_for(row_slots, mask_ids, b), seqs


@CUDA
@pytest.mark.parametrize("v", [1, 64, BLOCK, BLOCK + 1, 51200, 151936])
@pytest.mark.parametrize("b", [1, 3, 8, 64])
def test_the_kernel_matches_the_torch_path(v, b):
    logits, table, inputs, seqs = gpu_case(v, b, seed=v + b)
    sampler = make_sampler(b, v, torch.device("cuda"))
    got, want = [], []
    for run, out in ((sampler, got), (torch_greedy, want)):
        sampled, last = torch.full((b,), -1, device="cuda"), torch.full((seqs,), -7, device="cuda")
        flags = torch.ones(seqs, dtype=torch.bool, device="cuda")
        for _ in range(3):  # again and again: the arrival counters reset themselves
            run(logits.cuda(), table.cuda(), inputs.cuda(), b, sampled, last, flags)
        out.extend([sampled.cpu(), last.cpu(), flags.cpu()])
    assert_same_writes(got, want, inputs, b, seqs)
    assert int(sampler.arrived.sum()) == 0


def assert_same_writes(got, want, inputs, b, seqs):
    """Equal ``sampled``, flags and ``last_token``, except at the scratch row
    (``seqs - 1``) that padded rows share: there either padded row's token
    may land last (as with torch's ``index_copy_`` of repeated indices)."""
    (g_s, g_l, g_f), (w_s, w_l, w_f) = got, want
    assert torch.equal(g_s, w_s) and torch.equal(g_f, w_f)
    assert torch.equal(g_l[:-1], w_l[:-1])
    shared = [i for i in range(b) if int(inputs[i]) == seqs - 1]
    if shared:
        assert int(g_l[-1]) in {int(w_s[i]) for i in shared}
    else:
        assert int(g_l[-1]) == int(w_l[-1])


@CUDA
def test_the_kernel_replays_in_a_graph_on_new_logits_and_masks():
    v, b = 51200, 8
    logits, table, inputs, seqs = gpu_case(v, b, seed=3)
    logits, table, inputs = logits.cuda(), table.cuda(), inputs.cuda()
    sampler = make_sampler(b, v, torch.device("cuda"))
    sampled, last = torch.zeros(b, dtype=torch.long, device="cuda"), torch.zeros(seqs, dtype=torch.long, device="cuda")
    flags = torch.ones(seqs, dtype=torch.bool, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sampler(logits, table, inputs, b, sampled, last, flags)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampler(logits, table, inputs, b, sampled, last, flags)
    g = torch.Generator().manual_seed(11)
    for _ in range(5):
        logits.copy_(torch.randn(logits.shape, generator=g))
        table[1:3].copy_(torch.rand(2, v, generator=g) > 0.5)
        flags.fill_(True)
        last_before = last.clone()
        graph.replay()
        w_sampled, w_last, w_flags = torch.zeros_like(sampled), last_before, torch.ones_like(flags)
        torch_greedy(logits, table, inputs, b, w_sampled, w_last, w_flags)
        assert_same_writes([sampled.cpu(), last.cpu(), flags.cpu()],
                           [w_sampled.cpu(), w_last.cpu(), w_flags.cpu()], inputs.cpu(), b, seqs)
    assert int(sampler.arrived.sum()) == 0


@CUDA
def test_a_backend_gives_the_same_tokens_with_the_kernel_and_without():
    from bubblefree.cuda_backend.backend import CudaBackend
    from bubblefree.cuda_backend.drive import generate
    from bubblefree.cuda_backend.tiny import tiny_model

    prompts = [[1, 5, 9, 2], [3, 3, 3], [7] * 20]
    runs = []
    for on in (True, False):
        model = tiny_model("llama", device="cuda", seed=5)
        kernels = attrs.evolve(KernelConfig.measured("cuda", model.config), greedy_kernel=on)
        backend = CudaBackend(model, max_rows=8, max_seqs=8, num_pages=64, kernels=kernels)
        assert (backend._greedy is not None) == on
        allowed = frozenset(range(0, backend.vocab_size, 3))
        mask = backend.register_mask(allowed)
        runs.append(generate(backend, prompts, 12, mask_ids=[None, mask, None]))
    assert runs[0] == runs[1]
    assert [len(r) for r in runs[0]] == [12, 12, 12]
    assert set(runs[0][1]) <= allowed


PDL = pytest.mark.skipif(not torch.cuda.is_available() or not pdl.supported("cuda"),
                         reason="needs a GPU with dependent launches (Hopper)")


@CUDA
@pytest.mark.parametrize("v", [64, BLOCK + 1, 128256, 151936])
@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("launch_pdl", [False, pytest.param(True, marks=PDL)])
def test_sampling_ahead_in_the_kernel_matches_the_torch_path(v, b, dtype, launch_pdl):
    logits, _, inputs, seqs = gpu_case(v, b, seed=2 * v + b)
    logits, row_slots = logits.to(dtype).cuda(), inputs[:b].cuda()
    sampler = make_sampler(8, v, torch.device("cuda"))
    g = torch.Generator().manual_seed(b)
    start_last = torch.randint(0, 99, (seqs,), generator=g)
    start_flags = torch.rand(seqs, generator=g) > 0.5
    for at in (1, 0, 1):  # either slot, again: the arrival counters reset themselves
        got, want = [], []
        for run, out in ((sampler.ahead, got), (torch_ahead, want)):
            sampled, undo = torch.full((2, 8), -1, device="cuda"), torch.full((2, 16), -1, device="cuda")
            last, flags = start_last.cuda(), start_flags.cuda()
            extra = {"pdl": launch_pdl} if run is sampler.ahead else {}
            run(logits, row_slots, torch.tensor([at], device="cuda"), sampled, undo, last, flags,
                **extra)
            out.append([t.cpu() for t in (sampled, undo, last, flags)])
        (g_s, g_u, g_l, g_f), (w_s, w_u, w_l, w_f) = got[0], want[0]
        assert torch.equal(g_f, w_f) and torch.equal(g_s[1 - at], w_s[1 - at])
        real = [i for i in range(b) if int(inputs[i]) != seqs - 1]  # padded rows share the scratch row
        assert torch.equal(g_s[at, real], w_s[at, real]) and torch.equal(g_l[:-1], w_l[:-1])
        assert torch.equal(g_u[at, real], w_u[at, real])
        assert torch.equal(g_u[at, [8 + i for i in real]], w_u[at, [8 + i for i in real]])
        assert (g_u[1 - at] == -1).all()
    assert int(sampler.arrived.sum()) == 0


@PDL
@pytest.mark.parametrize("b", [1, 3])
def test_sampling_ahead_dependent_on_the_head_that_writes_its_logits(b):
    """In the step's order: a dependent-launch GEMM writes the logits (as
    the step's head does) and the kernel, launched dependent on it, reads
    its slots before its wait and the logits after. Replayed in a graph on
    new inputs, with ``last_token`` and the flags changed between replays
    (what the kernel keeps to undo is read before its wait), it writes what
    the torch path writes from the same logits."""
    v, k, seqs = 151936, 256, 12
    g = torch.Generator().manual_seed(b)
    x = torch.randn(b, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(v, k, generator=g) / 16).to(torch.bfloat16).cuda()
    row_slots = torch.randperm(seqs - 1, generator=g)[:b].cuda()
    at = torch.tensor([1], device="cuda")
    sampler = make_sampler(8, v, torch.device("cuda"))
    sampled, undo = torch.full((2, 8), -1, device="cuda"), torch.full((2, 16), -1, device="cuda")
    last = torch.zeros(seqs, dtype=torch.long, device="cuda")
    flags = torch.zeros(seqs, dtype=torch.bool, device="cuda")
    launch = normed_gemv.choose(k, v, False, 132)
    out = {}

    def step():
        out["logits"] = normed_gemv.run(x, w, None, launch, pdl=True)
        sampler.ahead(out["logits"], row_slots, at, sampled, undo, last, flags, pdl=True)

    graphs = GraphSet(torch.device("cuda"), True)
    graphs.capture("step", step)  # warmed up on a side stream, then recorded
    for i in range(4):
        x.copy_(torch.randn(b, k, generator=g))
        last.copy_(torch.randint(0, 99, (seqs,), generator=g))
        flags.copy_(torch.rand(seqs, generator=g) > 0.5)
        w_last, w_flags = last.clone(), flags.clone()
        w_sampled, w_undo = sampled.clone(), undo.clone()
        graphs.run("step", step)
        torch_ahead(out["logits"], row_slots, at, w_sampled, w_undo, w_last, w_flags)
        for got, want in ((sampled, w_sampled), (undo, w_undo), (last, w_last), (flags, w_flags)):
            assert torch.equal(got, want), i
    assert int(sampler.arrived.sum()) == 0
