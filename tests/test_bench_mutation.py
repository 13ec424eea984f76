"""The mutation run's shards, without running mutmut: which mutants a shard
selects, which package each belongs to, how its results are read back when
a stop cut a file short, and the report written from several shards' files."""

import json
import tomllib
from pathlib import Path

from bubblefree.bench import mutation
from bubblefree.bench.mutation_shard import (FORMAT, PACKAGES, file_name, load, package_of, read_meta,
                                             selected)

LAUNCH = "bubblefree.core.engine.xǁEngineǁ_launch__mutmut_5"  # judged equivalent in VERDICTS


def test_only_patterns_select_mutants_by_module():
    name = "bubblefree.core.pages.x_pages_needed__mutmut_3"
    assert selected(name, []) and selected(name, ["bubblefree.core*"]) and selected(name, [name])
    assert selected(name, ["bubblefree.fake_backend*", "bubblefree.core.pages*"])
    assert not selected(name, ["bubblefree.fake_backend*"])
    assert not selected(name, ["bubblefree.core.scheduler*"])


def test_mutants_are_placed_by_their_module_and_shown_by_their_file():
    take = "bubblefree.loop.xǁServingLoopǁ_take__mutmut_12"
    chained = "bubblefree.engine.x__chained__mutmut_2"
    assert package_of(take) == package_of(chained) == "serving"
    assert package_of("bubblefree.streams.xǁTextPiecesǁ__next__mutmut_1") == "serving"
    assert package_of("bubblefree.core.pages.x_pages_needed__mutmut_3") == "core"
    assert package_of("bubblefree.fake_backend.kv.x_g__mutmut_1") == "fake_backend"
    assert package_of("bubblefree.skills.text.x_f__mutmut_1") is None
    assert package_of("bubblefree.loopy.x_f__mutmut_1") is None
    assert mutation.where(take) == "bubblefree/loop.py: ServingLoop._take"
    assert mutation.where(chained) == "bubblefree/engine.py: _chained"
    assert mutation.where("bubblefree.core.pages.x_pages_needed__mutmut_3") == "core/pages.py: pages_needed"
    assert mutation.where(LAUNCH) == "core/engine.py: Engine._launch"


def test_the_packages_are_the_sources_mutmut_is_configured_with():
    config = tomllib.loads((Path(mutation.ROOT) / "pyproject.toml").read_text())["tool"]["mutmut"]
    configured = {p.rstrip("/").removesuffix(".py").replace("/", ".") for p in config["source_paths"]}
    assert configured == {m for modules in PACKAGES.values() for m in modules}
    assert set(PACKAGES) == set(mutation.TARGETS) == set(mutation.LABELS)


def test_a_score_counts_what_mutmut_counts_as_killed():
    statuses = {f"bubblefree.core.pages.x_f__mutmut_{i}": s for i, s in
                enumerate(["killed", "timeout", "segfault", "survived", "no tests", "suspicious",
                           "not checked", "skipped"])}
    assert mutation.scores(statuses)["core"] == (2, 6)


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


def test_the_serving_files_results_are_read_beside_the_layers(tmp_path):
    for path, name in [("bubblefree/core/pages.py", "bubblefree.core.pages.x_f__mutmut_1"),
                       ("bubblefree/loop.py", "bubblefree.loop.xǁServingLoopǁ_take__mutmut_1")]:
        meta = tmp_path / "mutants" / f"{path}.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": {name: 1}}))
    records = read_meta(tmp_path, {})
    assert records["bubblefree.loop.xǁServingLoopǁ_take__mutmut_1"]["path"] == "bubblefree/loop.py"
    assert len(records) == 2


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


def test_the_serving_layer_is_scored_without_a_target_and_older_files_still_merge(tmp_path):
    core, fake = _two_shards(tmp_path, fake_last="killed")  # files without a serving total
    whole_core = _shard(tmp_path / "c.json", ["bubblefree.core*"],  # a later run kills the survivor
                        {f"bubblefree.core.pages.x_f__mutmut_{i}": "killed" for i in range(3)} | {LAUNCH: "killed"}, {})
    loaded = "bubblefree.engine.xǁEngineǁfrom_pretrained__mutmut_1"
    take = "bubblefree.loop.xǁServingLoopǁ_take__mutmut_1"
    serving = {loaded: "no tests", take: "no tests", "bubblefree.loop.xǁServingLoopǁ_take__mutmut_2": "timeout",
               "bubblefree.handle.xǁHandleǁresult__mutmut_1": "killed"}
    files = [core, fake, whole_core,
             _shard(tmp_path / "s.json", ["bubblefree.loop*", "bubblefree.engine*", "bubblefree.handle*"], serving,
                    {loaded: ["return build_engine(cls)", "return None"], take: ["a", "b"]},
                    totals={"core": 4, "fake_backend": 3, "serving": 4})]
    section, ok, unjudged = mutation.merged(files)
    assert "**core/: 4 / 4 killed = 100.0%** (target 98%)." in section
    assert "**serving layer (bubblefree/loop.py, engine.py, handle.py, streams.py): 2 / 4 killed = 50.0%** " \
           "(no target set)." in section
    assert "| `bubblefree/engine.py: Engine.from_pretrained` | `return build_engine(cls)` → `return None` | " \
           "no tests | outside the subset: it builds a model on torch" in section
    assert "| `bubblefree/loop.py: ServingLoop._take` | `a` → `b` | no tests | **not judged yet** |" in section
    assert ok and unjudged == 1  # every target met, the serving layer's score aside
    assert "only the mutants matching" not in section and "mutants were not checked" not in section


def test_a_function_left_out_of_the_subset_excuses_only_mutants_no_test_reached():
    loaded = "bubblefree.engine.xǁEngineǁfrom_pretrained__mutmut_1"
    assert mutation.verdict(loaded, "no tests", "return None").startswith("outside the subset")
    assert mutation.verdict(loaded, "survived", "return None") is None
