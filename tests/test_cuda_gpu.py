"""GPU-only checks: streams, events, pinned buffers, CUDA graphs, I10 (no
host sync, no device allocation in a steady-state decode step), and bf16
agreement with transformers on a Phi-1.5-shaped decoder (moondream2's text
model, random weights). Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import PhiForCausalLM

from bubblefree.core.values import SamplePlan, SamplingParams, StepKind, StepPlan, StepRow
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.drive import generate, scattered_pages
from bubblefree.cuda_backend.errors import CacheTooSmall
from bubblefree.cuda_backend.sampling import Draw
from bubblefree.cuda_backend.tiny import phi15_config, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: streams, events, pinned memory and graphs")

PROMPTS = [[5, 9, 17, 33, 4], [7, 8], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2], [11] * 30]


def small(model, **kw):
    # Uncompiled unless a test asks: compiling costs seconds per backend, and
    # the compiled step has its own tests below.
    args = dict(page_size=16, num_pages=64, max_rows=8, max_seqs=16, max_prefill_tokens=256,
                max_context=256, compile_decode=False)
    args.update(kw)
    return CudaBackend(model, **args)


def default_path(model) -> str:
    """The fused step's name for ``model`` with this GPU's measured defaults:
    with the dependent launches where they are on for its shape
    (measured.MEASURED_PDL)."""
    from bubblefree.cuda_backend.kernel_config import KernelConfig
    from bubblefree.cuda_backend.pdl import supported
    rows = (KernelConfig.measured("cuda", model.config, dtype=model.dtype).pdl_rows
            if supported("cuda") else 0)
    return f"fused {model.config.model_type}" + (f", dependent launches up to {rows} rows" if rows else "")


def reference(model, prompts, new):
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p], device=model.device), max_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


def test_slots_use_pinned_buffers_events_and_two_streams():
    be = small(tiny_model("llama", device="cuda"))
    for s in be._slots:
        assert s.staging.is_pinned() and s.sample_staging.is_pinned() and s.landing.is_pinned()
        assert s.sampled_event is not None and s.copied_event is not None
        assert s.logits.device.type == "cuda"
    assert be._compute != be._copy != torch.cuda.default_stream()
    assert len(be._decode_graphs) == len(be._rows) * len(be._pages)
    assert len(be._sample_graphs) == 2 * len(Draw) * len(be._rows)  # per slot, kind of draw and bucket


def test_captures_wait_for_the_set_up_on_the_default_stream(monkeypatch):
    # A backend makes its buffers on the default stream (the runner's
    # last_token zeros among them) and warms its graphs up on the compute
    # stream, which does not wait for the default one by itself: a warm-up
    # that read a token id before its zeros landed read out of bounds. Held
    # back on purpose (about a second of device sleep after the runner's
    # set-up), the default stream must still be idle at every capture.
    from bubblefree.cuda_backend.graphs import GraphSet
    from bubblefree.cuda_backend.runner import ModelRunner
    idle = []
    capture, init = GraphSet.capture, ModelRunner.__init__

    def watched(self, key, fn):
        idle.append(torch.cuda.default_stream(self.device).query())
        return capture(self, key, fn)

    def late(self, *args, **kwargs):
        init(self, *args, **kwargs)
        torch.cuda._sleep(2_000_000_000)

    monkeypatch.setattr(GraphSet, "capture", watched)
    monkeypatch.setattr(ModelRunner, "__init__", late)
    small(tiny_model("llama", device="cuda"))
    assert idle and all(idle)


@pytest.mark.parametrize("arch", ["llama", "phi", "qwen2"])
def test_graphs_decode_like_transformers_in_float32(arch):
    model = tiny_model(arch, device="cuda")
    want = reference(model, PROMPTS, 12)
    be = small(model)
    assert be._decode_graphs.enabled
    assert generate(be, PROMPTS, 12, row_slots=[9, 3, 15, 0], page_seed=2) == want


def test_eager_and_graph_paths_agree():
    model = tiny_model("qwen2", device="cuda", seed=5)
    graphs = generate(small(model), PROMPTS, 10)
    eager = generate(small(model, use_graphs=False), PROMPTS, 10)
    assert graphs == eager


def test_masks_registered_after_capture_are_honoured():
    be = small(tiny_model("llama", device="cuda", seed=6), mask_capacity=2)
    allowed = frozenset({4, 40, 44})
    ids = [be.register_mask(frozenset({i})) for i in range(5)]  # the table grows: re-capture
    mask = be.register_mask(allowed)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    out = generate(be, PROMPTS, 6, sampling=params, mask_ids=[mask, ids[3], None, mask])
    assert set(out[0]) <= allowed and set(out[3]) <= allowed and set(out[1]) == {3}


@pytest.mark.parametrize("compiled", [False, True])
def test_steady_state_decode_makes_no_sync_and_no_allocation(compiled):
    """I10: around launch and finalize any host sync raises, and the caching
    allocator serves no new block. ``wait`` syncs on its copy's event by
    design, so it runs outside the debug mode."""
    be = small(tiny_model("phi", device="cuda", seed=2), max_rows=16, compile_decode=compiled)
    assert be._runner.compiled == compiled
    cap = be.capacity
    pages = scattered_pages([60] * 5, cap.page_size, cap.num_pages)
    prompt = tuple(range(3, 43))
    sampling = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(5)]
    rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=prompt, position=0, pages=pages[i],
                         sampling=sampling[i]) for i in range(5))
    be.launch(0, StepPlan(0, StepKind.PREFILL, rows))
    be.finalize(0, SamplePlan(0, (None,) * 5))
    for step in range(1, 12):
        slot = step % 2
        rows = tuple(StepRow(seq_id=i, row_slot=i, tokens=(), position=40 + step - 1,
                             pages=pages[i], sampling=sampling[i]) for i in range(5))
        steady = step > 3
        if steady:
            torch.cuda.synchronize()
            allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
            torch.cuda.set_sync_debug_mode("error")
        try:
            be.launch(slot, StepPlan(step, StepKind.DECODE, rows))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        be.wait(1 - slot)  # commit t while t+1 runs: blocks on t's copy event only
        be.release(1 - slot)
        if steady:
            torch.cuda.set_sync_debug_mode("error")
        try:
            be.finalize(slot, SamplePlan(step, (None,) * 5))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if steady:
            torch.cuda.synchronize()
            assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocs
    be.wait(11 % 2)
    be.release(11 % 2)


def test_memory_sized_cache():
    """Pages come from free device memory, capped at what max_seqs sequences
    of the full context could own; a budget below one page is refused."""
    be = CudaBackend(tiny_model("llama", device="cuda"), max_rows=8, max_seqs=8,
                     kv_memory_fraction=0.5, compile_decode=False)
    assert be.capacity.num_pages == 8 * 256 // 16
    del be
    gc.collect()
    torch.cuda.empty_cache()
    with pytest.raises(CacheTooSmall, match="one page"):
        CudaBackend(tiny_model("llama", device="cuda"), kv_memory_fraction=1e-9)


def test_phi15_shape_bf16_agrees_with_transformers():
    """Random bf16 weights: compare each of our greedy tokens with
    transformers' logits for the same sequence (teacher forcing); bf16 near
    ties may pick either token, so a token within a small margin of the
    maximum counts as agreeing."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = PhiForCausalLM(phi15_config())
    model = model.to(torch.bfloat16).eval()
    prompts = [list(range(100, 132)), list(range(7000, 7011))]
    be = CudaBackend(model, page_size=16, num_pages=256, max_rows=4, max_seqs=4,
                     max_prefill_tokens=128, max_context=512)
    assert be.decode_path == default_path(model) + ", compiled"  # the default is what is checked
    got = generate(be, prompts, 24)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for p, toks in zip(prompts, got):
            seq = torch.tensor([p + toks], device="cuda")
            logits = model(seq).logits[0, len(p) - 1:-1].float()  # [24, V]
            chosen = logits.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
            margin = logits.max(dim=1).values - chosen
            scale = logits.std(dim=1)
            exact = (logits.argmax(dim=1) == torch.tensor(toks, device="cuda")).float().mean()
            # Printed for the GPU validation record (run with -s).
            print(f"bf16 parity ({be.decode_path}), prompt of {len(p)}: {len(toks)} tokens, "
                  f"argmax agreement "
                  f"{exact.item():.3f}, worst margin {margin.max().item():.4f} "
                  f"(logit std {scale.mean().item():.3f})")
            assert (margin <= 0.1 * scale + 0.0625).all(), (margin, scale)
    del be, model
    gc.collect()
    torch.cuda.empty_cache()


def test_engine_on_gpu_pipelined_equals_blocking_equals_generate():
    from bubblefree.core.engine import Engine
    from bubblefree.core.values import Request

    model = tiny_model("llama", device="cuda", seed=11)
    want = reference(model, PROMPTS, 12)
    be = small(model, max_rows=2)  # more requests than rows: staggered admission
    for pipelined in (True, False):
        engine = Engine(be, pipelined=pipelined)
        handles = [engine.submit(Request(prompt=p, max_tokens=12)) for p in PROMPTS]
        engine.run_until_idle(max_ticks=10_000)
        assert [list(h.result.tokens) for h in handles] == want


# The split kernel's launches: (keys an iteration, warps, programs per (row, head) at most).
SPLIT_LAUNCHES = {"split": (32, 2, 64), "split16k1w": (16, 1, 64), "split64k4w4s": (64, 4, 4)}


@pytest.mark.parametrize("kernel", [*SPLIT_LAUNCHES, "1x32w2s1", "4x32w4s3", "8x16w2s1"])
@pytest.mark.parametrize("kv_heads,window,dtype,pages", [
    (4, None, torch.float32, 8), (1, None, torch.float32, 8), (2, 5, torch.float32, 8),
    (4, None, torch.bfloat16, 8), (4, None, torch.float32, 2), (2, 40, torch.float32, 160),
    (4, None, torch.bfloat16, 160)])
def test_paged_decode_kernel_matches_the_portable_path(kv_heads, window, dtype, pages, kernel):
    """The Triton kernels read pages in place; the portable path gathers them.
    Same function on scattered pages, mixed lengths, grouped heads, windows;
    the split kernel and one-pass launches of 1, 4 and 8 heads per program
    (8 is cut to the 4 heads there are), pipelined and not. Split: 2 pages
    (32 keys) are one program's chunk, 8 pages give four programs of one
    block, 160 (2,560 keys) forty of two blocks; also in blocks of 16 keys
    and one warp, and in at most four programs of 64-key blocks and four
    warps (8 pages: two programs of one block; 160: four of ten)."""
    from bubblefree.cuda_backend import paged_decode as pd
    from bubblefree.cuda_backend.attention import _decode_attention, _gather
    from bubblefree.cuda_backend.kernel_config import Dispatch, Launch
    assert pd.available(torch.zeros(1, device="cuda")), "Triton must be present on a CUDA machine"
    torch.manual_seed(kv_heads)
    rows, heads, dim, ps, total = 6, 4, 64, 16, 2 * 160
    keys = torch.randn(total * ps, kv_heads, dim, device="cuda", dtype=dtype)
    values = torch.randn(total * ps, kv_heads, dim, device="cuda", dtype=dtype)
    table = torch.stack([torch.randperm(total, device="cuda")[:pages] for _ in range(rows)])
    positions = torch.tensor([0, 3, 15, 16, min(40, pages * ps - 2), pages * ps - 1],
                             device="cuda")
    q = torch.randn(rows, heads, dim, device="cuda", dtype=dtype)
    kv_index = (table.unsqueeze(-1) * ps + torch.arange(ps, device="cuda")).view(rows, -1)
    key_pos = torch.arange(pages * ps, device="cuda")
    mask = key_pos <= positions[:, None]
    if window is not None:
        mask &= key_pos > positions[:, None] - window
    k, v = _gather(keys, values, kv_index, dtype)
    want = _decode_attention(q, k, v, mask, None).float()
    if kernel in SPLIT_LAUNCHES:  # called directly: the dispatch never splits a one-chunk bucket
        block, warps, most = SPLIT_LAUNCHES[kernel]
        got = pd.split_attention(q, keys, values, table, positions, ps, dim ** -0.5,
                                 window or pd.NO_WINDOW, max_splits=most, block=block,
                                 warps=warps)
    else:
        dispatch = Dispatch().forced(split_below=0, launch=Launch.parse(kernel))
        got = pd.paged_decode_attention(q, keys, values, table, positions, ps, None, window,
                                        dispatch=dispatch)
    got = got.float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("kernel", ["split", "1x16w1s1", "1x16w1s3", "4x32w4s3", "8x16w2s1"])
@pytest.mark.parametrize("kv_heads,window,dtype,pages,rot", [
    (4, None, torch.float32, 8, 64), (1, None, torch.float32, 8, 32), (2, 5, torch.float32, 8, 64),
    (4, None, torch.bfloat16, 8, 32), (4, None, torch.float32, 2, 64),
    (2, 40, torch.float32, 160, 32), (4, None, torch.bfloat16, 160, 64), (4, 1, torch.float32, 8, 64)])
def test_rotary_and_kv_write_in_the_kernel_match_the_portable_op(kv_heads, window, dtype, pages,
                                                                 rot, kernel):
    """rope_attention's op on CUDA (the kernels with a NewToken: rotary on q
    and k, the KV write by each group's first head, the step's own key from
    registers) against its torch path: same output, same cache. Rows own
    disjoint pages (I6), positions start a page (16), end one (15), and sit
    at 0 (the own key alone); a window of 1 sees only the own key; full and
    partial rotary; raw q/k/v as strided views of one projection output."""
    from bubblefree.cuda_backend.kernel_config import Dispatch, Launch
    from bubblefree.cuda_backend.rope_attention import _portable, rope_attend
    from tests.attention_case import DIM as dim
    from tests.attention_case import PAGE as ps
    from tests.attention_case import rope_case
    torch.manual_seed(kv_heads * 7 + rot)
    caches, table, positions, slot, q, k, v, cos, sin, win = rope_case(kv_heads, window, dtype,
                                                                       pages, rot)
    want = _portable(q, k, v, cos, sin, caches[1].layer_kv(0), slot, table, positions, ps,
                     dim ** -0.5, win).float()
    dispatch = (Dispatch().forced(split_below=1 << 30) if kernel == "split"
                else Dispatch().forced(split_below=0, launch=Launch.parse(kernel)))
    got = rope_attend(q, k, v, cos, sin, caches[0].layer_kv(0), slot, table, positions, ps,
                      None, window, dispatch=dispatch).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    # The rows' slots written alike (to rounding: the kernel may fuse a multiply-add), nothing else.
    torch.testing.assert_close(caches[0].data, caches[1].data)


@pytest.mark.parametrize("kernel", ["split", "1x16w1s1", "4x32w4s3"])
@pytest.mark.parametrize("act,dtype,inter", [(1, torch.bfloat16, 8192), (2, torch.float32, 200),
                                             (1, torch.float32, 37)])
def test_the_mlp_activation_rides_on_the_attention_kernels(kernel, act, dtype, inter):
    """With a parallel block's fc1 output the op returns ``[attention |
    act(fc1)]``, the activation shared among each row's programs (shares
    that do not divide evenly, fewer columns than programs, Phi's 8,192)."""
    from bubblefree.cuda_backend.kernel_config import Dispatch, Launch
    from bubblefree.cuda_backend.kv_cache import PagedKVCache
    from bubblefree.cuda_backend.rope_attention import _torch_act, rope_attend
    torch.manual_seed(inter)
    rows, heads, kv_heads, dim, ps, pages = 6, 8, 2, 64, 16, 8
    cache = PagedKVCache(layers=1, kv_heads=kv_heads, head_dim=dim, num_pages=rows * pages,
                         page_size=ps, dtype=dtype, device=torch.device("cuda"))
    cache.data.normal_()
    table = torch.randperm(rows * pages, device="cuda").view(rows, pages)
    positions = torch.tensor([0, 3, 15, 16, 40, pages * ps - 1], device="cuda")
    slot = table.gather(1, (positions // ps)[:, None])[:, 0] * ps + positions % ps
    q = torch.randn(rows, heads, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(rows, kv_heads, dim, device="cuda", dtype=dtype) for _ in range(2))
    theta = torch.rand(rows, dim // 4, device="cuda") * 6
    cos, sin = (f(torch.cat((theta, theta), 1)).to(dtype) for f in (torch.cos, torch.sin))
    mlp = (torch.randn(rows, inter + 3, device="cuda", dtype=dtype) * 3)[:, 3:]
    dispatch = (Dispatch().forced(split_below=1 << 30) if kernel == "split"
                else Dispatch().forced(split_below=0, launch=Launch.parse(kernel)))
    before = cache.data.clone()
    row = rope_attend(q, k, v, cos, sin, cache.layer_kv(0), slot, table, positions, ps, None,
                      None, mlp, act, dispatch=dispatch)
    cache.data.copy_(before)
    attention = rope_attend(q, k, v, cos, sin, cache.layer_kv(0), slot, table, positions, ps,
                            None, None, dispatch=dispatch)
    assert row.shape == (rows, heads * dim + inter)
    torch.testing.assert_close(row[:, :heads * dim], attention.reshape(rows, -1))
    torch.testing.assert_close(row[:, heads * dim:], _torch_act(mlp, act).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,tile", [
    (1, 2048, 96, "64n128k1s4w3p"), (5, 512, 2048, "32n128k4s4w3p"),
    (33, 1024, 100, "128n128k2s4w3p"), (64, 256, 64, "64n128k2s4w3p")])
def test_skinny_gemm_matches_cublas(m, k, n, tile, dtype):
    """Our decode-sized GEMM against F.linear: columns past a block (N=100,
    96), rows padded to the tile, K split or not, with and without bias."""
    from bubblefree.cuda_backend import skinny_gemm
    from bubblefree.cuda_backend.kernel_config import Tile
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    for bias in (torch.randn(n, device="cuda", dtype=dtype), None):
        want = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = skinny_gemm.run(x, w, bias, Tile.parse(tile)).float()
        assert got.shape == (m, n)
        err = ((got - want).norm() / want.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("arch,compiled", [("phi", True), ("llama", False)])
def test_our_gemm_in_the_decode_step_keeps_tokens(arch, compiled, monkeypatch):
    """With tiles for every fused weight shape (whole K at one row, K split
    in two up to 8 rows, cuBLAS beyond), the step runs our GEMM, compiled as
    an opaque op or not, and greedy tokens do not change."""
    from bubblefree.cuda_backend import skinny_gemm
    from bubblefree.cuda_backend.kernel_config import KernelConfig, Tile, TileTable
    model = tiny_model(arch, device="cuda", seed=4)
    want = generate(small(model), PROMPTS, 10)
    shapes = {"phi": [(64, 320), (192, 64)],
              "llama": [(64, 128), (64, 64), (64, 256), (128, 64)]}[arch]
    one, two = Tile(32, 32, 1, 4, 3), Tile(32, 32, 2, 4, 3)
    kernels = KernelConfig(tiles=TileTable({s: ((1, one), (8, two)) for s in shapes}))
    ran = []
    real = skinny_gemm.run
    monkeypatch.setattr(skinny_gemm, "run", lambda x, w, b, t: ran.append(t) or real(x, w, b, t))
    be = small(model, compile_decode=compiled, kernels=kernels)
    assert {one, two} <= set(ran), "the step never ran our GEMM"
    assert generate(be, PROMPTS, 10) == want


@pytest.mark.parametrize("arch,fused", [("phi", True), ("llama", True), ("qwen2", True),
                                        ("phi", False)])
def test_compiled_decode_agrees_with_the_eager_graphs(arch, fused):
    """compile_decode: torch.compile'd decode step (fused or transformers'),
    captured in our graphs, with the paged kernel as an opaque custom op;
    tokens unchanged."""
    model = tiny_model(arch, device="cuda", seed=4)
    want = generate(small(model, fused_decode=False), PROMPTS, 10)
    be = small(model, compile_decode=True, fused_decode=fused)
    path = default_path(model) if fused else "transformers"
    assert be.decode_path == f"{path}, compiled", "the compiled step failed to capture"
    assert generate(be, PROMPTS, 10) == want


@pytest.mark.parametrize("arch", ["llama", "phi", "qwen2"])
def test_token_prefill_graphs_match_the_padded_prefill(arch):
    """Prefill as token rows, replayed from graphs, against transformers'
    padded prefill run eagerly: same tokens; a prefill too long for the
    token path still takes the eager one."""
    model = tiny_model(arch, device="cuda", seed=7)
    prompts = PROMPTS + [list(range(3, 90))]
    want = generate(small(model, token_prefill=0), prompts, 8, page_seed=3)
    be = small(model)
    tp = be._runner.token_prefill
    assert be.prefill_path.startswith("token rows in graphs")
    assert len(be._prefill_graphs) == len(tp.keys())
    assert generate(be, prompts, 8, page_seed=3) == want
    tp.key_budget = 10  # nothing fits: the eager path, same answer
    assert generate(be, prompts, 8, page_seed=3) == want


def test_the_default_on_cuda_is_the_fused_compiled_step():
    model = tiny_model("llama", device="cuda")
    be = CudaBackend(model, page_size=16, num_pages=64, max_rows=4, max_seqs=4, max_prefill_tokens=128,
                     max_context=128)
    assert be.decode_path == default_path(model) + ", compiled"
    assert be.prefill_path == "token rows in graphs up to 128 tokens, else transformers"
