"""``bench.load_grid`` against one fake-engine server and then two: every
cell measured and checked, the clients spread (one client reaches only the
first server, two reach both); ``bench.load_compare`` sets the two records
side by side, each cell's ratio judged against the target, a cell whose
checks failed named as such."""

from __future__ import annotations

import json

from bubblefree.bench import load_compare, load_grid
from server_support import fake_engine, serving


def test_the_grid_against_one_server_then_two(tmp_path):
    grid = ["--workloads", "query", "--clients", "1,2", "--duration", "0.5", "--warmup", "0.2",
            "--images", "0", "--max-tokens", "4"]
    with fake_engine(delay_s=0.002) as e1, fake_engine(delay_s=0.002) as e2, serving(e1) as a, serving(e2) as b:
        one = load_grid.main(["--url", a, *grid, "--label", "one", "--record", str(tmp_path / "one.json")])
        two = load_grid.main(["--url", a, "--url", b, *grid, "--record", str(tmp_path / "two.json")])
    for record in (one, two):
        assert [(c["workload"], c["clients"]) for c in record["cells"]] == [("query", 1), ("query", 2)]
        assert [w["clients"] for w in record["warmup"]] == [2]
        for cell in record["cells"]:
            assert all(cell["checks"].values()) and not cell["errors"], cell
            assert cell["completed"] > 0 and cell["req_s"] > 0
    assert [[s["clients"] for s in c["servers"]] for c in two["cells"]] == [[1, 0], [1, 1]]
    assert two["cells"][0]["servers"][1]["requests"] == 0
    assert all(s["requests"] > 0 for s in two["cells"][1]["servers"])
    assert json.loads((tmp_path / "two.json").read_text())["urls"] == [a, b]
    # The command the docs show shapes the load; where its record went is no part of it.
    assert two["command"].startswith(f"python -m bubblefree.bench.load_grid --url {a} --url {b} --workloads")
    assert "--record" not in two["command"] and str(tmp_path) not in two["command"]


def _cell(workload, clients, req_s, *, lost=False, errors=None):
    return dict(workload=workload, clients=clients, req_s=req_s, latency_ms=[10.0, 20.0], ttft_ms=[None, None],
                errors=errors or {}, load_cpu=[0.1], checks={"no request still live (0)": not lost})


def _record(urls, cells):
    return dict(urls=urls, env="", date="2026-01-01", model="m", command="grid",
                settings=dict(duration_s=5, warmup_s=2, images=8, image_side=378, max_tokens=10, stream=0.5,
                              leave=0.05), cells=cells)


def _compare(tmp_path, one: dict, two: dict, *args: str) -> str:
    """``load_compare`` on the two records, written as files first."""
    for name, record in (("one.json", one), ("two.json", two)):
        (tmp_path / name).write_text(json.dumps(record))
    return load_compare.main([str(tmp_path / "one.json"), str(tmp_path / "two.json"), *args])


def test_the_comparison_judges_each_cell_against_the_target(tmp_path):
    one = _record(["a"], [_cell("query", 1, 10.0), _cell("point", 8, 10.0), _cell("point", 32, 10.0)])
    two = _record(["a", "b"], [_cell("query", 1, 10.2), _cell("point", 8, 19.0),
                               _cell("point", 32, 17.0, lost=True, errors={"HTTP 504": 2})])
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Speed benchmarks\n\nearlier runs stay\n")
    text = _compare(tmp_path, one, two, "--out", str(doc), "--note", "Two processes, not Ray Serve.")
    rows = {line.split(" | ")[0] + " " + line.split(" | ")[1]: line for line in text.splitlines()
            if line.startswith("| query") or line.startswith("| point")}
    assert "| 1.02 | no |" in rows["| query 1"]
    assert "| 1.90 | yes |" in rows["| point 8"]
    assert "| 1.70 | no |" in rows["| point 32"]
    assert "none / **no request still live (0)**" in rows["| point 32"] and "0 / HTTP 504: 2" in rows["| point 32"]
    assert "Met in 1 of 3 cells: point x8." in text and "With 1 client(s) the other server(s) get none" in text
    assert "Two processes, not Ray Serve." in text
    written = doc.read_text()
    assert "earlier runs stay" in written and text in written
    assert written.count(f"<!-- {load_compare.BLOCK}:begin -->") == 1
    # An image sent twice in a cell is said, so "different" is never claimed for it.
    assert "sent an image again" not in text
    two["cells"][2]["images_reused"] = 5
    assert "; but 5 requests in all sent an image again within their cell" in load_compare.render(one, two, 1.8)


def test_replicas_behind_one_address_are_counted_and_said_in_their_own_block(tmp_path):
    """A Ray Serve record: one address, two replicas behind it. The ratio's
    column names two, the text says Ray Serve, the single client is not
    excused (the router may send it anywhere), and the section lands in
    the block named, beside the two-process one."""
    one = dict(_record(["r", "r"], [_cell("query", 1, 10.0), _cell("query", 32, 10.0)]), replicas=1)
    two = dict(_record(["r", "r"], [_cell("query", 1, 10.0), _cell("query", 32, 19.0)]), replicas=2)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- load-replicas:begin -->\nthe two processes\n<!-- load-replicas:end -->\n")
    text = _compare(tmp_path, one, two, "--out", str(doc), "--block", "load-ray")
    assert "| req/s, 2 servers | 2 ÷ 1 |" in text and "| 1.90 | yes |" in text
    assert "## Load: one server against 2 on Ray Serve" in text and "`serve --replicas 2`" in text
    assert "2 load processes send them" in text  # one address given twice: two senders, not four replicas
    assert "Met in 1 of 2 cells: query x32." in text and "get none" not in text
    written = doc.read_text()
    assert "the two processes" in written and "<!-- load-ray:begin -->" in written and text in written


def test_each_cell_is_handed_on_as_it_is_measured():
    """A run cut short keeps its measured cells: ``after`` sees each one as
    it ends, the warm-up (untimed, at the most clients) never among them."""
    from bubblefree.bench.load import Load

    class Spread:
        urls = ["a"]

        def __init__(self):
            self.asked = []

        def run(self, load):
            self.asked.append((load.workload, load.clients, load.duration_s))
            return _cell(load.workload, load.clients, 1.0) | dict(completed=1, requests=1, servers=[])

    spread, seen = Spread(), []
    load_grid.cells(spread, Load(url="a", duration_s=4), ["query", "point"], [1, 8], warmup_s=2, say=lambda s: None,
                    after=lambda rows, warm: seen.append(([(r["workload"], r["clients"]) for r in rows], len(warm))))
    assert spread.asked == [("query", 8, 2), ("query", 1, 4), ("query", 8, 4),
                            ("point", 8, 2), ("point", 1, 4), ("point", 8, 4)]
    assert seen == [([("query", 1)], 1), ([("query", 1), ("query", 8)], 1),
                    ([("query", 1), ("query", 8), ("point", 1)], 2),
                    ([("query", 1), ("query", 8), ("point", 1), ("point", 8)], 2)]
