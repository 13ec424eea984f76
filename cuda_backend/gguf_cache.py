"""GGUF files, dequantized once by transformers and cached as safetensors.

The cache key is the file's name, size, modification time and a digest of
its first MiB, so a replaced file is converted again. A conversion is
written to a temporary folder and renamed into place, so an interrupted
one never leaves a half-written entry that a later load would trust.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from bubblefree.cuda_backend.errors import ModelLoadError


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("BUBBLEFREE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bubblefree"


def cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
    return f"{path.stem}-{h.hexdigest()[:16]}"


def converted_dir(path: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached safetensors directory for GGUF ``path``, converting if needed."""
    root = cache_root(cache_dir) / "gguf"
    target = root / cache_key(path)
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        _convert(path, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(path: Path, out: Path) -> None:
    folder, name = str(path.parent), path.name
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the per-tensor progress is noise here
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as ex:  # noqa: BLE001 - corrupt or unsupported GGUF
        raise ModelLoadError(f"GGUF file {path}: cannot load it: {ex}") from ex
    finally:
        hf_logging.set_verbosity(verbosity)
    # The weights are dequantized float32 now; drop the GGUF quantization
    # marker so transformers saves (and later loads) them as plain weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
