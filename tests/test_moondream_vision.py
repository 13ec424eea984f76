"""moondream2's vision encoder against transformers' SigLIP with the same
weights, and the projection written out."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image
from transformers import SiglipVisionConfig, SiglipVisionModel

from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.image_crops import overlap_crops, reconstruct
from bubblefree.cuda_backend.moondream.vision import normalize, patchify
from bubblefree.cuda_backend.moondream.weights import random_model


def _siglip_from(vision) -> SiglipVisionModel:
    c = vision.config
    config = SiglipVisionConfig(hidden_size=c.dim, intermediate_size=c.ff_dim,
                                num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                                num_channels=c.in_channels, image_size=c.crop_size,
                                patch_size=c.patch_size, layer_norm_eps=c.ln_eps,
                                hidden_act="gelu_pytorch_tanh", vision_use_head=False,
                                attn_implementation="eager")
    ours = vision.state_dict()
    state = {
        "embeddings.patch_embedding.weight":
            ours["patch_emb.weight"].view(c.dim, c.in_channels, c.patch_size, c.patch_size),
        "embeddings.patch_embedding.bias": ours["patch_emb.bias"],
        "embeddings.position_embedding.weight": ours["pos_emb"][0],
        "post_layernorm.weight": ours["post_ln.weight"],
        "post_layernorm.bias": ours["post_ln.bias"],
    }
    for i in range(c.n_layers):
        src, dst = f"blocks.{i}", f"encoder.layers.{i}"
        for part in ("weight", "bias"):
            q, k, v = ours[f"{src}.attn.qkv.{part}"].chunk(3)
            state.update({f"{dst}.self_attn.q_proj.{part}": q, f"{dst}.self_attn.k_proj.{part}": k,
                          f"{dst}.self_attn.v_proj.{part}": v,
                          f"{dst}.self_attn.out_proj.{part}": ours[f"{src}.attn.proj.{part}"],
                          f"{dst}.layer_norm1.{part}": ours[f"{src}.ln1.{part}"],
                          f"{dst}.layer_norm2.{part}": ours[f"{src}.ln2.{part}"],
                          f"{dst}.mlp.fc1.{part}": ours[f"{src}.mlp.fc1.{part}"],
                          f"{dst}.mlp.fc2.{part}": ours[f"{src}.mlp.fc2.{part}"]})
    model = SiglipVisionModel(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_the_encoder_matches_siglip_with_the_same_weights():
    vision = random_model(tiny_config(), seed=3).vision
    siglip = _siglip_from(vision)
    pixels = torch.randn(2, 3, 378, 378, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = vision.encode(pixels)                                      # [2, 729, 32]
        theirs = siglip(pixel_values=pixels).last_hidden_state
    assert ours.shape == (2, 729, 32)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_patch_is_flattened_channel_major_like_a_conv_kernel():
    vision = random_model(tiny_config(), seed=4).vision
    pixels = torch.zeros(1, 3, 378, 378)
    pixels[0, 2, 14 + 5, 2 * 14 + 7] = 1.0        # channel 2, patch (1, 2), offset (5, 7)
    with torch.no_grad():
        embedded = vision.patch_emb(patchify(pixels, 14))
    column = 2 * 14 * 14 + 5 * 14 + 7
    expected = vision.patch_emb.bias + vision.patch_emb.weight[:, column]
    torch.testing.assert_close(embedded[0, 1 * 27 + 2], expected)
    torch.testing.assert_close(embedded[0, 0], vision.patch_emb.bias.expand(32))


def test_the_forward_pools_the_local_grid_and_projects_beside_the_global_view():
    model = random_model(tiny_config(), seed=5)
    vision = model.vision
    pixels = (torch.arange(600 * 800 * 3) % 251).to(torch.uint8).reshape(600, 800, 3).numpy()
    crops, plan = overlap_crops(Image.fromarray(pixels), vision.config)
    assert plan.tiling == (2, 4)
    with torch.no_grad():
        out = vision(crops, plan.tiling)                                   # [729, 64]
        features = vision.encode(normalize(crops, torch.float32))           # [9, 729, 32]
        grid = reconstruct(features[1:].reshape(8, 27, 27, 32), (2, 4), 4)  # [46, 84, 32]
        # Adaptive average pooling written out: cell (i, j) averages rows
        # floor(i*H/27) .. ceil((i+1)*H/27) - 1, and likewise columns.
        h, w = grid.shape[:2]
        pooled = torch.stack([torch.stack([
            grid[(i * h) // 27:-((-(i + 1) * h) // 27), (j * w) // 27:-((-(j + 1) * w) // 27)]
            .mean(dim=(0, 1)) for j in range(27)]) for i in range(27)]).reshape(729, 32)
        x = torch.cat([features[0], pooled], dim=-1)
        fc1, fc2 = vision.proj_mlp.fc1, vision.proj_mlp.fc2
        expected = fc2(F.gelu(fc1(x), approximate="tanh"))
    assert out.shape == (729, 64)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    prefix = model.image_prefix(Image.fromarray(pixels))
    assert prefix.shape == (730, 64)
    torch.testing.assert_close(prefix[1:], out)
    torch.testing.assert_close(prefix[0], model.text.wte[model.config.tokenizer.bos_id])
