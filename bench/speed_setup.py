"""The speed benchmark's setup: the model shapes, the read-bandwidth floor, time limits."""

from __future__ import annotations

import contextlib
import math
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


# The benchmark's model shapes, with random weights: a transformers config
# each, as the published model's config.json gives it (no weights, nothing
# downloaded). ``tiny`` is the architecture of the small CPU stand-in.
SHAPES = {
    "phi": dict(cls="PhiForCausalLM", tiny="phi", config=phi15_config,
                label="Phi-1.5 shape (moondream2's text decoder: 24 layers, hidden 2048, vocab 51200)"),
    "llama1b": dict(cls="LlamaForCausalLM", tiny="llama", config=lambda: transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192)),
        label="Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 KV heads, vocab 128256, "
              "tied embeddings)"),
    "qwen05b": dict(cls="Qwen2ForCausalLM", tiny="qwen2", config=lambda: transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151643, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        use_sliding_window=False),
        label="Qwen2-0.5B shape (24 layers, hidden 896, 14 heads, 2 KV heads, vocab 151936, "
              "tied embeddings)"),
}


def build_model(tiny: bool, seed: int = 0, shape: str = "phi"):
    spec = SHAPES[shape]
    if tiny:
        return (tiny_model(spec["tiny"], seed=seed, vocab_size=512),
                f"tiny random {spec['tiny']} (CPU, fp32)")
    if not torch.cuda.is_available():
        raise SystemExit("bench.speed needs CUDA (or --tiny for a CPU run)")
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = getattr(transformers, spec["cls"])(spec["config"]())
    model = model.to(torch.bfloat16).eval()
    torch.cuda.empty_cache()  # the fp32 copy's memory goes back to the device
    return model, f"{spec['label']}, random bf16 weights"


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: each parameter once (tied
    embeddings are one tensor, read whole by the LM head; an untied input
    embedding, only gathered, is counted too)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def read_bandwidth(device: torch.device, reps: int = 10) -> tuple[float, str]:
    """Bytes read per second by a read-only kernel, the best of ``reps``
    timed one by one (torch's sum over a 4 GiB tensor on CUDA, 64 MiB on the
    CPU), and how it was measured. A decode step at batch 1 reads every
    weight once, so weights ÷ this is its floor."""
    cuda = device.type == "cuda"
    n = (4 << 30) if cuda else (64 << 20)
    x = torch.ones(n // 4, dtype=torch.float32, device=device)
    for _ in range(3):
        x.sum()
    best = math.inf
    for _ in range(reps if cuda else 3):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            s.record()
            x.sum()
            e.record()
            torch.cuda.synchronize(device)
            seconds = s.elapsed_time(e) / 1e3
        else:
            t = time.perf_counter()
            x.sum()
            seconds = time.perf_counter() - t
        best = min(best, seconds)
    del x
    if cuda:
        torch.cuda.empty_cache()
    return n / best, f"torch's sum over {n / 1e9:.2f} GB of float32, best of {reps if cuda else 3}"
