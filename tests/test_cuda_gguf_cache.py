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


def test_an_entry_without_the_completion_marker_converts_again(tmp_path, conversions):
    """A crash before the weights reached the disk left an entry that every
    later load trusted, or one without config.json that no load could use."""
    cache = tmp_path / "cache"
    path = gguf(tmp_path / "model.gguf")
    entry = gguf_cache.converted_dir(path, cache)
    assert (entry / "complete").is_file()
    (entry / "complete").unlink()
    (entry / "model.safetensors").write_bytes(b"cut sh")
    assert gguf_cache.converted_dir(path, cache) == entry and conversions == [path, path]
    assert sorted(p.name for p in entry.iterdir()) == ["complete", "config.json"]
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]


def test_two_conversions_at_once_leave_one_complete_entry(tmp_path, monkeypatch):
    """The second process finishes while the first converts: the first's
    rename fails onto a complete entry, which it returns."""
    cache = tmp_path / "cache"
    path = gguf(tmp_path / "model.gguf")
    done = []

    def convert(source, out):
        done.append(out.name)
        if len(done) == 1:  # the other process, start to finish
            assert gguf_cache.converted_dir(source, cache).name.startswith("sha256-")
        (out / "config.json").write_text(f'{{"by": "{out.name}"}}')
    monkeypatch.setattr(gguf_cache, "_convert", convert)
    entry = gguf_cache.converted_dir(path, cache)
    assert len(done) == 2 and (entry / "complete").is_file()
    assert (entry / "config.json").read_text() == f'{{"by": "{done[1]}"}}'
    assert [p.name for p in (cache / "gguf").iterdir()] == [entry.name]


def test_killed_conversions_leftovers_are_swept_and_live_ones_kept(tmp_path, conversions):
    import socket
    import subprocess
    import sys
    import time
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = socket.gethostname()
    entries = tmp_path / "cache" / "gguf"
    names = {"dead": f".convert-{gone}@{host}-a1", "old": ".convert-b2",
             "live": f".convert-{os.getpid()}@{host}-c3", "elsewhere": f".convert-{gone}@not-{host}-d4"}
    for name in names.values():
        (entries / name).mkdir(parents=True)
        (entries / name / "model.safetensors").write_bytes(b"partial")
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(entries / names["old"], (day_ago, day_ago))
    entry = gguf_cache.converted_dir(gguf(tmp_path / "model.gguf"), tmp_path / "cache")
    kept = sorted([entry.name, names["live"], names["elsewhere"]])
    assert sorted(p.name for p in entries.iterdir()) == kept


class _Unwritable:
    """``tempfile``'s calls failing as on a read-only file system."""

    def __getattr__(self, name):
        import tempfile
        return getattr(tempfile, name)

    @staticmethod
    def _refuse(*args, **kwargs):
        import errno
        raise OSError(errno.EROFS, "Read-only file system")

    mkstemp = mkdtemp = _refuse


def test_a_read_only_cache_holding_the_entry_loads_it(tmp_path, conversions, monkeypatch):
    """The digest memo's write failed the load of an entry that was there."""
    cache = tmp_path / "cache"
    path = gguf(tmp_path / "model.gguf")
    entry = gguf_cache.converted_dir(path, cache)
    shutil.rmtree(cache / "digests")  # a baked image ships the entries only
    monkeypatch.setattr(gguf_cache, "tempfile", _Unwritable())
    assert gguf_cache.converted_dir(path, cache) == entry and conversions == [path]


def test_a_cache_that_cannot_be_written_is_a_load_error_naming_it(tmp_path, conversions, monkeypatch):
    from bubblefree.cuda_backend.errors import ModelLoadError
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf_cache, "tempfile", _Unwritable())
    with pytest.raises(ModelLoadError, match=f"^GGUF cache {cache / 'gguf'}: cannot write the conversion of "
                                             "model.gguf: Read-only file system$"):
        gguf_cache.converted_dir(gguf(tmp_path / "model.gguf"), cache)


class _Model:
    """What ``_convert`` touches of a transformers model."""

    def __init__(self, save):
        self.config = type("Config", (), {})()
        self.hf_quantizer = object()
        self.save_pretrained = save


def test_a_full_disk_while_saving_is_a_load_error_naming_the_cache(tmp_path, monkeypatch):
    """safetensors' own error, not an OSError, came out raw."""
    from safetensors import SafetensorError

    from bubblefree.cuda_backend.errors import ModelLoadError

    def save(out):
        (out / "model.safetensors").write_bytes(b"part")
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")
    monkeypatch.setattr(gguf_cache, "_load_gguf", lambda path: (_Model(save), None))
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=f"^GGUF cache {cache / 'gguf'}: cannot write the conversion of "
                                             "model.gguf: .*No space left on device"):
        gguf_cache.converted_dir(gguf(tmp_path / "model.gguf"), cache)
    assert list((cache / "gguf").iterdir()) == []


def test_a_gguf_missing_tensors_is_refused_and_not_cached(tmp_path, monkeypatch):
    """transformers filled them with random values, and the cache kept them
    as the file's conversion."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    missing = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(5)]
    saved = []

    class Auto:
        @staticmethod
        def from_pretrained(folder, **kwargs):
            assert kwargs["output_loading_info"] and kwargs["trust_remote_code"] is False
            return _Model(saved.append), {"missing_keys": set(missing)}
    monkeypatch.setattr(gguf_cache, "AutoModelForCausalLM", Auto)
    monkeypatch.setattr(gguf_cache, "AutoTokenizer", type("Tokenizer", (), {
        "from_pretrained": staticmethod(lambda folder, **kwargs: object())}))
    path = gguf(tmp_path / "model.gguf")
    with pytest.raises(ModelLoadError, match=rf"^GGUF file {path}: it has no tensors for "
                                             rf"{missing[0]}, {missing[1]}, {missing[2]} and 2 more; "
                                             "they would be random$"):
        gguf_cache.converted_dir(path, tmp_path / "cache")
    assert saved == [] and list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_one_file_of_a_split_gguf_is_refused_naming_it(tmp_path, monkeypatch):
    import gguf as gguf_lib

    from bubblefree.cuda_backend.errors import ModelLoadError

    class Auto:  # a file without tensors: transformers would build a default-sized model
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise AssertionError("read a split file's part as the whole model")
    monkeypatch.setattr(gguf_cache, "AutoModelForCausalLM", Auto)
    path = tmp_path / "model-00001-of-00003.gguf"
    writer = gguf_lib.GGUFWriter(str(path), arch="llama")
    writer.add_uint16("split.count", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"it is one of 3 split files \(split.count\)"):
        gguf_cache._convert(path, tmp_path / "out")
