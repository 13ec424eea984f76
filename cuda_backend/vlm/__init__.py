"""Transformers vision-language models (LLaVA) on the two-slot pipeline.

The model's own vision tower and projector turn an image into features; an
IMAGE_PREFILL row's prefix is the chat template's head (the tokens before
the image, BOS and the user turn's start), then one position per feature,
and its prompt the rest of the turn. The prefill writes the features where
transformers' ``masked_scatter`` would put them and runs the text decoder
causally over everything, as ``generate`` does; decode steps are the
CudaBackend's. ``model.supported`` says which architectures this covers and
why the others are refused.
"""
