"""Small random decoders built from configs, for tests and benchmarks.

Nothing is downloaded: each model is a transformers class built from a
config with random weights. ``phi15_config`` is the shape of moondream2's
text decoder (the peers' benchmark model).
"""

from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PhiConfig, PhiForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM,
              dict(num_key_value_heads=2, intermediate_size=128)),
    "phi": (PhiConfig, PhiForCausalLM,
            dict(partial_rotary_factor=0.5, intermediate_size=128)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(num_key_value_heads=2, intermediate_size=128)),
}


def tiny_config(arch: str, **overrides):
    config_cls, _, extra = ARCHITECTURES[arch]
    args = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    args.update(extra)
    args.update(overrides)
    return config_cls(**args)


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **overrides):
    """A random ``arch`` decoder (eval mode). A large ``initializer_range``
    keeps its logits peaked, so greedy parity is not decided by rounding."""
    _, model_cls, _ = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype).eval()


def phi15_config() -> PhiConfig:
    return PhiConfig(vocab_size=51200, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=24, num_attention_heads=32, partial_rotary_factor=0.5,
                     max_position_embeddings=2048)
