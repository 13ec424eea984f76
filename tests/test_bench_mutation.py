"""The mutation run's shards, without running mutmut: which mutants a shard
selects, how its results are read back when a stop cut a file short, and
the report written from several shards' files."""

import json

from bubblefree.bench import mutation
from bubblefree.bench.mutation_shard import FORMAT, file_name, load, read_meta, selected

LAUNCH = "bubblefree.core.engine.xǁEngineǁ_launch__mutmut_5"  # judged equivalent in VERDICTS


def test_only_patterns_select_mutants_by_module():
    name = "bubblefree.core.pages.x_pages_needed__mutmut_3"
    assert selected(name, []) and selected(name, ["bubblefree.core*"]) and selected(name, [name])
    assert selected(name, ["bubblefree.fake_backend*", "bubblefree.core.pages*"])
    assert not selected(name, ["bubblefree.fake_backend*"])
    assert not selected(name, ["bubblefree.core.scheduler*"])


def test_a_shard_file_is_named_by_its_patterns():
    assert file_name(["bubblefree.core*"]) == "mutation-bubblefree.core.json"
    assert file_name([]) == "mutation-all.json"
    assert file_name(["bubblefree.core.pages*", "bubblefree.fake_backend*"]) == \
        "mutation-bubblefree.core.pages_bubblefree.fake_backend.json"
    many = [f"bubblefree.core.module{i}*" for i in range(10)]
    assert len(file_name(many)) < 100 and file_name(many) != file_name(many[1:])


def test_a_half_written_meta_file_is_read_from_its_last_copy(tmp_path):
    meta = tmp_path / "mutants" / "bubblefree" / "core" / "pages.py.meta"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"exit_code_by_key": {"bubblefree.core.pages.x_f__mutmut_1": 1,
                                                     "bubblefree.core.pages.x_f__mutmut_2": None},
                                "durations_by_key": {"bubblefree.core.pages.x_f__mutmut_1": 0.5}}))
    last = {}
    first = read_meta(tmp_path, last)
    assert first["bubblefree.core.pages.x_f__mutmut_1"] == {"path": "bubblefree/core/pages.py", "code": 1,
                                                            "s": 0.5}
    assert first["bubblefree.core.pages.x_f__mutmut_2"]["code"] is None
    meta.write_text(meta.read_text()[:40])  # a stop in the middle of mutmut's write
    assert read_meta(tmp_path, last) == first
    assert read_meta(tmp_path, {}) == {}  # never read whole: left out, not guessed


def _shard(path, only, mutants, changes, stopped=False, totals=None):
    data = dict(format=FORMAT, date="2026-12-01", machine="x86_64", cpus=16, max_children=16, only=only,
                totals=totals or {"core": 4, "fake_backend": 3}, wall_s=500.0, stopped_at_budget=stopped,
                exit_code=None if stopped else 0, phases_s={},
                mutants={n: {"path": "p.py", "status": s, "s": 1.0} for n, s in mutants.items()},
                changes=changes)
    path.write_text(json.dumps(data))
    return path


def _two_shards(tmp_path, fake_last="not checked"):
    core = {f"bubblefree.core.pages.x_f__mutmut_{i}": "killed" for i in range(3)} | {LAUNCH: "survived"}
    fake = {"bubblefree.fake_backend.kv.x_g__mutmut_1": "killed",
            "bubblefree.fake_backend.kv.x_g__mutmut_2": "timeout",
            "bubblefree.fake_backend.kv.x_g__mutmut_3": fake_last}
    return [_shard(tmp_path / "a.json", ["bubblefree.core*"], core, {LAUNCH: ["return True", "return False"]}),
            _shard(tmp_path / "b.json", ["bubblefree.fake_backend*"], fake, {}, stopped=True)]


def test_shards_merge_into_one_report_with_each_survivor_judged(tmp_path):
    section, ok, unjudged = mutation.merged(_two_shards(tmp_path))
    assert "on x86_64 (16 CPUs)" in section and "2 shards of 16 workers merged" in section
    assert "`bubblefree.fake_backend*` (3 mutants, 500 s, stopped at its budget with 1 not checked)" in section
    assert "**core/: 3 / 4 killed = 75.0%**" in section and "**fake_backend/: 2 / 2 killed" in section
    assert "1 mutants were not checked" in section
    assert "| `core/engine.py: Engine._launch` | `return True` → `return False` | survived | equivalent:" in section
    assert not ok and unjudged == 0  # below target, and not every mutant checked
    assert "only the mutants matching" not in section  # the shards cover both packages


def test_a_shard_run_twice_keeps_its_checked_result(tmp_path):
    first, second = _two_shards(tmp_path, fake_last="killed")
    again = _shard(tmp_path / "c.json", ["bubblefree.fake_backend*"],
                   {"bubblefree.fake_backend.kv.x_g__mutmut_3": "not checked"}, {}, stopped=True)
    statuses, _, runs = load([first, second, again])
    assert statuses["bubblefree.fake_backend.kv.x_g__mutmut_3"] == "killed" and len(runs) == 3


def test_a_partial_set_of_shards_is_reported_as_such(tmp_path):
    core, _ = _two_shards(tmp_path)
    section, ok, _ = mutation.merged([core])
    assert "only the mutants matching `bubblefree.core*`" in section and "**fake_backend/: not run.**" in section
    assert not ok
