"""The CUDA backend: real transformers decoders behind the Backend protocol.

Usage::

    from bubblefree.cuda_backend import CudaBackend, load_model
    loaded = load_model()                      # the embedded SmolLM2 (GGUF), or a
                                               # directory / .gguf path
    ids = loaded.add_tokens(["<loc_0>"])       # optional, before the backend
    backend = CudaBackend(loaded, max_rows=32)
    engine = core.engine.Engine(backend)
    prompt = loaded.tokenizer(text).input_ids
    engine.submit(Request(prompt=prompt, max_tokens=64, stop_ids=loaded.stop_ids))

Modules, one idea each: ``loader`` (models, tokenizers, stop ids, GGUF via
``gguf_cache``), ``attention`` (paged attention through transformers'
AttentionInterface), ``paged_decode`` (decode attention that reads pages
in place; its Triton kernels in ``paged_decode_kernels``),
``rope_attention`` (a fused decode step's rotary, KV write and attention as
one op), ``skinny_gemm`` (a Triton GEMM for decode-sized inputs, where
measured faster than cuBLAS), ``kernel_config`` (which kernels a step runs:
one frozen value per backend, with the measured defaults),
``fused_decode`` (the decode step with fused projections, for Phi, Llama
and Qwen2), ``token_prefill`` (short prefills as token rows, in
graphs), ``kv_cache`` (the pages), ``sizing`` (model shape,
page count), ``runner`` (plan checks, metadata packing, the forward),
``sampling`` (masks, greedy / temperature / top-p, seeded per position),
``slots`` (the two DecodeSlots), ``graphs`` (CUDA graphs per bucket),
``backend`` (the protocol), ``tiny`` and ``drive`` (small models and a
hand-driven loop for tests and benchmarks).
"""

from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import CacheTooSmall, ModelLoadError, PlanRejected, UnsupportedModel
from bubblefree.cuda_backend.loader import LoadedModel, default_model_path, load_model

__all__ = ["CudaBackend", "LoadedModel", "load_model", "default_model_path", "ModelLoadError",
           "UnsupportedModel", "CacheTooSmall", "PlanRejected"]
