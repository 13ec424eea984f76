"""Transformers VLMs (LLaVA(-NeXT), Idefics3, SmolVLM2, PaliGemma, Qwen2(.5)-VL) on two slots.

The model's own processor expands an image's token into a block (a
placeholder per feature, and the tokens around them); its vision tower and
projector turn the image into features. An IMAGE_PREFILL row's prefix is
the chat template's head (the tokens before the image) and that block, its
prompt the rest of the turn. The prefill writes the features over the
placeholders, where transformers' ``masked_scatter`` would put them, and
runs the text decoder over everything as ``generate`` does (causally, or
PaliGemma's prompt both ways);
decode steps are the CudaBackend's. ``model.supported`` says which
architectures this covers and why the others are refused.
"""
