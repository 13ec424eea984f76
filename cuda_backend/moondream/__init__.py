"""moondream2, native: transformers has no moondream class.

One idea per module: ``config`` (shapes, prompt templates), ``layers``
(MLP, fused-qkv attention), ``image_crops`` (overlapping crops and the
feature grid's reconstruction), ``vision`` (SigLIP-style encoder and the
projection), ``text`` (the Phi-shaped decoder, the image-prefix mask, the
bridge to transformers' Phi), ``region`` (coordinates and sizes in and
out), ``model`` (the three parts together), ``weights`` (local
checkpoints, random weights). Served by the engine: ``prepared`` (an
image's crops on the host, ``EncodedImage``), ``runner`` (the decode step
with values fed back, the image prefill), ``region_head`` (the spatial
decode in finalize), ``backend`` (``MoondreamBackend``), ``build``.
Image input lives in ``bubblefree.images``.
"""
