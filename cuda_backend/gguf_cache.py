"""GGUF files, dequantized once by transformers and cached as safetensors.

An entry is keyed by the SHA-256 of the file's bytes, so a reinstall, a copy
at another path or a touched file reuses the entry, and only changed content
converts again. Hashing a few hundred MB on every load would cost more than
the memory-mapped load itself, so the digest is remembered in a small memo
keyed by the file's identity (path, size, inode, modification and change
times). Any write to the file changes its change time, which no caller can
set back, so a stale memo is never trusted.

A conversion is written to a temporary folder and renamed into place, so an
interrupted one never leaves a half-written entry that a later load would
trust. Entries written under an earlier key scheme (``<stem>-<hex>``) are
left alone: another installation sharing the cache may still read them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.quiet import quiet_transformers

_CHUNK = 8 << 20


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("BUBBLEFREE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "bubblefree"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _identity(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)


def content_digest(path: Path, root: Path) -> str:
    """SHA-256 of ``path``'s bytes, from the memo under ``root`` when the
    file is unchanged since it was hashed."""
    before = _identity(path)
    memo = root / "digests" / hashlib.sha256(repr(before).encode()).hexdigest()[:32]
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            return digest
    except OSError:
        pass
    digest = file_sha256(path)
    if _identity(path) == before:  # written to while hashing: hash again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".memo-", dir=memo.parent)
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    return digest


def cache_key(path: Path, root: Path) -> str:
    return f"sha256-{content_digest(path, root)[:32]}"


def converted_dir(path: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached safetensors directory for GGUF ``path``, converting if needed."""
    root = cache_root(cache_dir)
    entries = root / "gguf"
    _make_dir(entries, cache_dir)
    target = entries / cache_key(path, root)
    if (target / "config.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=entries))
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


def _make_dir(folder: Path, cache_dir: str | os.PathLike | None) -> None:
    """``folder`` under the cache root, made where absent; a root that is a
    file or cannot be written is refused naming where it came from."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        origin = "cache_dir" if cache_dir is not None else "BUBBLEFREE_CACHE"
        if cache_dir is None and not os.environ.get("BUBBLEFREE_CACHE"):
            origin = "the cache folder"
        raise ModelLoadError(f"{origin} {cache_root(cache_dir)}: cannot hold the GGUF cache: "
                             f"{err.strerror or err}") from err


def _convert(path: Path, out: Path) -> None:
    folder, name = str(path.parent), path.name
    try:
        with quiet_transformers():  # the per-tensor progress is noise here
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as ex:  # noqa: BLE001 - corrupt or unsupported GGUF
        raise ModelLoadError(f"GGUF file {path}: cannot load it: {ex}") from ex
    # The weights are dequantized float32 now; drop the GGUF quantization
    # marker so transformers saves (and later loads) them as plain weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
