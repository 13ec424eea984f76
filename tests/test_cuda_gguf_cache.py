"""The converted-GGUF cache is keyed by the file's content: a copy at another
path or a touched file reuses its entry, changed bytes convert again, and an
unchanged file is not hashed again on every load."""

from __future__ import annotations

import os
import shutil

import pytest

from bubblefree.cuda_backend import gguf_cache


@pytest.fixture
def conversions(monkeypatch):
    """Stand-in for transformers' dequantization: records each GGUF it
    converts and writes a minimal entry."""
    done = []

    def convert(path, out):
        done.append(path)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_cache, "_convert", convert)
    return done


def gguf(path, body=b"weights"):
    path.write_bytes(b"GGUF" + body)
    return path


def test_a_copy_or_a_touched_file_reuses_the_entry(tmp_path, conversions):
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    first = gguf(tmp_path / "a" / "model.Q4.gguf")
    entry = gguf_cache.converted_dir(first, cache)
    assert (entry / "config.json").is_file() and conversions == [first]

    copy = tmp_path / "reinstalled" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    assert gguf_cache.converted_dir(copy, cache) == entry
    st = first.stat()
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gguf_cache.converted_dir(first, cache) == entry
    assert conversions == [first]
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]


def test_changed_content_converts_again(tmp_path, conversions):
    cache = tmp_path / "cache"
    path = gguf(tmp_path / "model.gguf", b"v1")
    old = gguf_cache.converted_dir(path, cache)
    gguf(path, b"v2")  # same size, same name
    new = gguf_cache.converted_dir(path, cache)
    assert new != old and conversions == [path, path]
    assert gguf_cache.converted_dir(path, cache) == new and len(conversions) == 2


def test_an_unchanged_file_is_hashed_once(tmp_path, conversions, monkeypatch):
    cache = tmp_path / "cache"
    path = gguf(tmp_path / "model.gguf")
    hashed = []
    real = gguf_cache.file_sha256
    monkeypatch.setattr(gguf_cache, "file_sha256", lambda p: hashed.append(p) or real(p))
    entry = gguf_cache.converted_dir(path, cache)
    for _ in range(3):
        assert gguf_cache.converted_dir(path, cache) == entry
    assert hashed == [path]
    gguf(path, b"other bytes")
    gguf_cache.converted_dir(path, cache)
    assert hashed == [path, path]


def test_a_corrupt_memo_is_not_trusted(tmp_path, conversions):
    cache = tmp_path / "cache"
    path = gguf(tmp_path / "model.gguf")
    entry = gguf_cache.converted_dir(path, cache)
    for memo in (cache / "digests").iterdir():
        memo.write_text("not a digest")
    assert gguf_cache.converted_dir(path, cache) == entry
    assert entry.name == f"sha256-{gguf_cache.file_sha256(path)[:32]}"
