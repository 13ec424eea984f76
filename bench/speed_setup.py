"""The speed benchmark's setup: the model, the copy-bandwidth floor, time limits."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import torch
import transformers

from bubblefree.cuda_backend.tiny import phi15_config, tiny_model


# Ways to run a decode step (CudaBackend options); benchmarks name one.
DECODE_PATHS = {"transformers": dict(fused_decode=False, compile_decode=False),
                "transformers+compile": dict(fused_decode=False, compile_decode=True),
                "fused": dict(fused_decode=True, compile_decode=False),
                "fused+compile": dict(fused_decode=True, compile_decode=True)}


class Clock:
    """Seconds since the run began, and progress lines stamped with them."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)


class TimeLimit(BaseException):
    """Not an Exception: the backend turns any Exception inside a step into a
    failed step and carries on; a time limit must end the whole cell."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise ``TimeLimit`` in this thread after ``seconds`` (main thread only)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum, frame):
        raise TimeLimit(f"stopped after its limit of {seconds:.3g} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def build_model(tiny: bool, seed: int = 0):
    if tiny:
        return tiny_model("phi", seed=seed, vocab_size=512), "tiny random Phi (CPU, fp32)"
    if not torch.cuda.is_available():
        raise SystemExit("bench.speed needs CUDA (or --tiny for a CPU run)")
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = transformers.PhiForCausalLM(phi15_config())
    model = model.to(torch.bfloat16).eval()
    torch.cuda.empty_cache()  # the fp32 copy's memory goes back to the device
    return (model,
            "Phi-1.5 shape (moondream2's text decoder: 24 layers, hidden 2048, vocab 51200), "
            "random bf16 weights")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    cuda = device.type == "cuda"
    n = (2 << 30) if cuda else (64 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    reps = 10 if cuda else 3
    if cuda:
        torch.cuda.synchronize(device)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            y.copy_(x)
        e.record()
        torch.cuda.synchronize(device)
        seconds = s.elapsed_time(e) / 1e3
        del x, y
        torch.cuda.empty_cache()
    else:
        t = time.perf_counter()
        for _ in range(reps):
            y.copy_(x)
        seconds = time.perf_counter() - t
    return 2 * n * reps / seconds
