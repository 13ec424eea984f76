"""The peer for image requests: a transformers VLM of moondream2's shape
(SigLIP 27 x 1152 at 378 px, a projector, Phi-1.5 text), random bf16,
timed with plain ``generate`` in the same run as the engine.

transformers has no moondream class, so the peer is a LLaVA built from the
same sizes: one 378-px crop (729 image tokens after BOS), the prompt, then
``new_tokens`` greedy tokens. ``streams`` requests go as one batch of equal
shapes (no padding to hide), a fresh image each; latency is the batch's
wall time, so its req/s is ``streams / wall``. A point-like request is 3
new tokens (moondream's x, y and the end), a short query 10.
"""

from __future__ import annotations

import statistics
import time

import torch

IMAGE_TOKEN = 50000
BOS = 50256
PROMPT = list(range(100, 112))  # 12 prompt tokens after the image


def make_peer(device: torch.device, dtype: torch.dtype = torch.bfloat16, tiny: bool = False):
    """The peer's LLaVA; ``tiny``: the same structure at CPU-test widths
    (28-px images of 4 patches)."""
    import transformers as tf

    if tiny:
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        text = tf.PhiConfig(vocab_size=51200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, partial_rotary_factor=0.5, max_position_embeddings=2048)
    else:
        vision = tf.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                       num_attention_heads=16, image_size=378, patch_size=14)
        text = tf.PhiConfig(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                            num_attention_heads=32, partial_rotary_factor=0.5, max_position_embeddings=2048)
    features = (vision.image_size // vision.patch_size) ** 2
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                            vision_feature_select_strategy="full", vision_feature_layer=-1,
                            projector_hidden_act="gelu", image_seq_length=features)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlavaForConditionalGeneration(config)
    return model.to(dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_requests(model, device: torch.device, streams: int, new_tokens: int, reps: int = 5) -> dict:
    """``streams`` requests of ``new_tokens`` as one ``generate`` batch."""
    ids = torch.tensor([[BOS] + [IMAGE_TOKEN] * model.config.image_seq_length + PROMPT] * streams,
                       device=device)
    side = model.config.vision_config.image_size
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None)

    def once() -> float:
        pixels = torch.randn(streams, 3, side, side, device=device, dtype=model.dtype)  # fresh images
        _sync(device)
        start = time.perf_counter()
        model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids), **kwargs)
        _sync(device)
        return time.perf_counter() - start

    once()  # warm-up with the timed shapes
    walls = sorted(once() for _ in range(reps))
    p50 = statistics.median(walls)
    return dict(req_s=streams / p50, p50_ms=1e3 * p50, p99_ms=1e3 * walls[-1])


@torch.inference_mode()
def encoder_ms_per_crop(model, device: torch.device, crops: int = 8, reps: int = 10) -> float:
    pixels = torch.randn(crops, 3, 378, 378, device=device, dtype=model.dtype)
    tower = model.model.vision_tower if hasattr(model, "model") else model.vision_tower
    tower(pixels)
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        tower(pixels)
    _sync(device)
    return 1e3 * (time.perf_counter() - start) / (reps * crops)
