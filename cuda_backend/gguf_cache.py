"""GGUF files, dequantized once by transformers and cached as safetensors.

An entry is keyed by the SHA-256 of the file's bytes, so a reinstall, a copy
at another path or a touched file reuses the entry, and only changed content
converts again. Hashing a few hundred MB on every load would cost more than
the memory-mapped load itself, so the digest is remembered in a small memo
keyed by the file's identity (path, size, inode, modification and change
times). Any write to the file changes its change time, which no caller can
set back, so a stale memo is never trusted. The memo is a convenience: a
cache that cannot be written (a read-only image) only hashes again.

A conversion is written to a temporary folder (``.convert-<pid>@<host>-*``),
its files flushed to disk, then a ``complete`` marker written last, and the
folder renamed into place. Only an entry holding the marker is trusted: one
without it (a crash before the data reached the disk, or an earlier version's
entry) is set aside and converted again. Two processes converting at once
each write their own folder; the first rename wins and the second finds a
complete entry. Temporary folders of killed conversions are swept at the
start of the next conversion: those of a process on this host that is gone,
and any untouched for a day. Entries written under an earlier key scheme
(``<stem>-<hex>``) are left alone: another installation sharing the cache may
still read them.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.quiet import quiet_transformers

_CHUNK = 8 << 20
_COMPLETE = "complete"  # written last into an entry; an entry without it is not trusted
_TEMP = ".convert-"
_STALE_S = 24 * 3600  # a temporary folder untouched this long belongs to no live conversion


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
        _remember(memo, digest)
    return digest


def _remember(memo: Path, digest: str) -> None:
    """Write the memo, best effort: a cache that cannot be written (read-only,
    full) only costs hashing the file again on the next load."""
    tmp = None
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".memo-", dir=memo.parent)
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def cache_key(path: Path, root: Path) -> str:
    return f"sha256-{content_digest(path, root)[:32]}"


def converted_dir(path: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached safetensors directory for GGUF ``path``, converting if needed."""
    root = cache_root(cache_dir)
    entries = root / "gguf"
    _make_dir(entries, cache_dir)
    target = entries / cache_key(path, root)
    if _complete(target):
        return target
    try:
        _sweep(entries)
        tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(), dir=entries))
    except OSError as err:
        raise _write_error(entries, path, err) from err
    try:
        _convert(path, tmp)
        _seal(tmp)
        _install(tmp, target)
    except OSError as err:
        raise _write_error(entries, path, err) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_error(entries: Path, path: Path, err: Exception) -> ModelLoadError:
    why = getattr(err, "strerror", None) or err
    return ModelLoadError(f"GGUF cache {entries}: cannot write the conversion of {path.name}: {why}")


def _complete(entry: Path) -> bool:
    return (entry / _COMPLETE).is_file()


def _temp_prefix() -> str:
    # The owner in the name lets a later conversion tell a killed one's
    # leftovers from a live one's.
    return f"{_TEMP}{os.getpid()}@{socket.gethostname()}-"


def _seal(folder: Path) -> None:
    """Flush the conversion's files to disk, then mark it complete: after a
    crash the marker is never on disk ahead of the weights it vouches for."""
    for file in folder.rglob("*"):
        if file.is_file():
            _fsync(file)
    (folder / _COMPLETE).write_text("")
    _fsync(folder / _COMPLETE)
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, target: Path) -> None:
    """Rename the sealed ``tmp`` to ``target``, moving an incomplete entry
    there out of the way first."""
    if target.exists():
        _discard_incomplete(target)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same conversion first
        if not _complete(target):
            raise
    with contextlib.suppress(OSError):  # the rename itself durable; the entry is whole either way
        _fsync(target.parent)


def _discard_incomplete(target: Path) -> None:
    """Rename ``target`` aside and delete it. Renaming first keeps another
    process from reading a half-deleted entry; an entry another process
    completed between our check and the rename goes back in place."""
    aside = Path(tempfile.mkdtemp(prefix=_temp_prefix(), dir=target.parent))
    try:
        os.replace(target, aside)  # onto the empty folder: rename(2) allows it
        if _complete(aside):
            with contextlib.suppress(OSError):
                os.replace(aside, target)
    except FileNotFoundError:  # another process moved it first
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _sweep(entries: Path) -> None:
    """Delete what killed conversions left behind, best effort: a folder that
    cannot be removed costs disk space, not the load."""
    now = time.time()
    for folder in entries.glob(f"{_TEMP}*"):
        try:
            if _abandoned(folder.name, folder.stat().st_mtime, now):
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue


def _abandoned(name: str, mtime: float, now: float) -> bool:
    """Whether the temporary folder ``name`` belongs to no live conversion:
    its process, on this host, is gone, or it is a day old. Another host's
    process (a cache on a shared volume) is judged by age alone."""
    pid, _, rest = name[len(_TEMP):].partition("@")
    host = rest.rpartition("-")[0]
    if pid.isdigit() and host == socket.gethostname() and not _alive(int(pid)):
        return True
    return now - mtime > _STALE_S


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


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
    _refuse_split(path)
    model, tokenizer = _load_gguf(path)
    # The weights are dequantized float32 now; drop the GGUF quantization
    # marker so transformers saves (and later loads) them as plain weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        with quiet_transformers():
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    except Exception as ex:  # noqa: BLE001 - a full disk is safetensors' own error, not an OSError
        raise _write_error(out.parent, path, ex) from ex


def _load_gguf(path: Path):
    """The model and tokenizer transformers reads from ``path``, refused where
    the file lacks tensors the model has: transformers would fill them with
    random values, and the cache would keep them as if converted."""
    folder, name = str(path.parent), path.name
    try:
        with quiet_transformers():  # the per-tensor progress is noise here
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=torch.float32, local_files_only=True,
                output_loading_info=True, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                      trust_remote_code=False)
    except Exception as ex:  # noqa: BLE001 - corrupt or unsupported GGUF
        raise ModelLoadError(f"GGUF file {path}: cannot load it: {ex}") from ex
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"GGUF file {path}: it has no tensors for {', '.join(missing[:3])}{more}; "
                             "they would be random")
    return model, tokenizer


def _refuse_split(path: Path) -> None:
    """A file of a split GGUF (llama.cpp's ``-00001-of-00003``) holds only
    some of the tensors; transformers reads one file, so the rest would be
    random. Its header says so; a header that cannot be read is left to
    transformers' load to name."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).get_field("split.count")
        count = int(field.contents()) if field is not None else 1
    except Exception:  # noqa: BLE001 - not readable as a GGUF here
        return
    if count > 1:
        raise ModelLoadError(f"GGUF file {path}: it is one of {count} split files (split.count); "
                             "merge them into one file (llama.cpp's gguf-split --merge) to load it")
