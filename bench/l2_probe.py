"""What asking L2 for weights costs the kernel that asks and saves the one that reads them
(docs/runs/l2-ahead-2026-12-01g.txt): X MB asked by 132 programs, a line a request
(prefetch.global.L2) or in TMA bulk prefetches, then summed by 264 programs; L2 flushed by a
512 MB write before each; medians of 15, in us. On CUDA with Triton only."""
import torch
import triton
import triton.language as tl

from bubblefree.cuda_backend.l2_ahead import _l2


@triton.jit
def pf_line(addr, per_lines, LINES: tl.constexpr):
    lo = tl.program_id(0).to(tl.int64) * per_lines
    for i in range(0, per_lines, LINES):
        idx = tl.minimum(i + tl.arange(0, LINES), per_lines - 1)
        _l2((addr + (lo + idx.to(tl.int64)) * 128).to(tl.pointer_type(tl.int8)))


@triton.jit
def pf_bulk(addr, per_bytes, LINES: tl.constexpr):
    # each of LINES elements one bulk prefetch of per_bytes / LINES (a multiple of 16)
    chunk = per_bytes // LINES
    a = addr + tl.program_id(0).to(tl.int64) * per_bytes + tl.arange(0, LINES).to(tl.int64) * chunk
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                              [a.to(tl.pointer_type(tl.int8)), tl.full([LINES], chunk, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def read(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(p * BLOCK, n, tl.num_programs(0) * BLOCK):
        r = i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + r, mask=r < n).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc))


def main():
    dev = "cuda"
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    big = torch.randn(64 << 20, dtype=torch.bfloat16, device=dev)  # 128 MB
    out = torch.empty(264, device=dev)
    P = 132

    def t(fn, before=None, reps=15):
        ts = []
        for _ in range(reps):
            flush.fill_(1)
            if before:
                before()
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); fn(); e.record(); torch.cuda.synchronize()
            ts.append(s.elapsed_time(e) * 1000)
        ts.sort()
        return ts[len(ts) // 2]

    print("| MB | read cold us | prefetch line: kernel us | read after us | read after (+sleep) us | bulk: kernel us | read after (+sleep) us | read warm us |")
    for mb in (2, 8, 16, 32):
        n = (mb << 20) // 2
        x = big[:n]
        per_lines = (mb << 20) // 128 // P
        per_bytes = (mb << 20) // P // 2048 * 2048
        rd = lambda: read[(P * 2,)](x, n, out, BLOCK=1024, num_warps=4)
        pl = lambda: pf_line[(P,)](x.data_ptr(), per_lines, LINES=256, num_warps=4)
        pb = lambda: pf_bulk[(P,)](x.data_ptr(), per_bytes, LINES=128, num_warps=4)
        rd(); pl(); pb(); torch.cuda.synchronize()
        cold = t(rd)
        k_line = t(pl)
        after = t(rd, before=pl)
        after_s = t(rd, before=lambda: (pl(), torch.cuda._sleep(20000)))
        k_bulk = t(pb)
        bulk_s = t(rd, before=lambda: (pb(), torch.cuda._sleep(20000)))
        warm = t(rd, before=rd)
        print(f"| {mb} | {cold:.1f} | {k_line:.1f} | {after:.1f} | {after_s:.1f} | {k_bulk:.1f} | {bulk_s:.1f} | {warm:.1f} |", flush=True)


if __name__ == "__main__":
    main()
