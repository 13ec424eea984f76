"""Two load-grid records side by side (``bench/load_grid.py``): one server,
then the same load against more; each cell's req/s ratio against a target.

    python -m bubblefree.bench.load_compare ONE.json TWO.json [--target 1.8]
        [--note "..."] [--out docs/benchmarks.md] [--record docs/runs/load-replicas.json]

Prints the table; ``--out`` writes it into the document between its own
markers, ``--record`` both records as one JSON file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bubblefree.bench.doc_block import write_block

BLOCK = "load-replicas"  # the document's markers: <!-- load-replicas:begin --> ... :end


def served(record: dict) -> int:
    """Engines behind a grid record: its addresses (an address given twice,
    for two load processes, once) times the replicas behind each."""
    return len(set(record["urls"])) * record.get("replicas", 1)


def _how(two: dict, n: int) -> str:
    if two.get("replicas", 1) > 1:
        senders = len(two["urls"])
        return (f"Then {n} replicas on Ray Serve behind one address (`serve --replicas {n}`: Ray's router "
                f"spreads the requests; {senders} load process{'es' if senders > 1 else ''} send them, as "
                f"against the one replica): `{two['command']}`.")
    return (f"Then {n} servers, the first one again and more beside it, the load generator spreading the "
            f"clients (client i asks server i mod {n}, each server's clients in a load process of their "
            f"own): `{two['command']}`.")


def _pair(values: list[float | None]) -> str:
    return " / ".join("–" if v is None else f"{v:,.1f}" for v in values)


def _errors(r: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"


def _lost(r: dict) -> str:
    """'none' when every check after the cell held, else the checks that failed."""
    failed = [name for name, ok in r["checks"].items() if not ok]
    return "none" if not failed else "**" + "; ".join(failed) + "**"


def pairs(one: dict, two: dict) -> list[tuple[dict, dict | None]]:
    theirs = {(c["workload"], c["clients"]): c for c in two["cells"]}
    return [(c, theirs.get((c["workload"], c["clients"]))) for c in one["cells"]]


def table(one: dict, two: dict, target: float) -> str:
    n = served(two)
    lines = [f"| workload | clients | req/s, 1 server | req/s, {n} servers | {n} ÷ 1 | ≥ {target}× | "
             f"latency p50 / p99 ms, 1 | latency p50 / p99 ms, {n} | TTFT p50 / p99 ms, 1 | "
             f"TTFT p50 / p99 ms, {n} | errors, 1 / {n} | lost requests or pages, 1 / {n} | load CPU, 1 / {n} |",
             "|---|---:|---:|---:|---:|---|---|---|---|---|---|---|---|"]
    for a, b in pairs(one, two):
        if b is None:
            lines.append(f"| {a['workload']} | {a['clients']} | {a['req_s']:,.1f} | – | – | – | "
                         f"{_pair(a['latency_ms'])} | – | {_pair(a['ttft_ms'])} | – | {_errors(a)} / – | "
                         f"{_lost(a)} / – | {a['load_cpu']} / – |")
            continue
        ratio = b["req_s"] / a["req_s"] if a["req_s"] else float("nan")
        lines.append(f"| {a['workload']} | {a['clients']} | {a['req_s']:,.1f} | {b['req_s']:,.1f} | "
                     f"{ratio:.2f} | {'yes' if ratio >= target else 'no'} | {_pair(a['latency_ms'])} | "
                     f"{_pair(b['latency_ms'])} | {_pair(a['ttft_ms'])} | {_pair(b['ttft_ms'])} | "
                     f"{_errors(a)} / {_errors(b)} | {_lost(a)} / {_lost(b)} | {a['load_cpu']} / {b['load_cpu']} |")
    return "\n".join(lines)


def verdict(one: dict, two: dict, target: float) -> str:
    n = served(two)
    met = [(a, b) for a, b in pairs(one, two) if b and a["req_s"] and b["req_s"] / a["req_s"] >= target]
    cells = [(a, b) for a, b in pairs(one, two) if b]
    few = sorted({a["clients"] for a, _ in cells if a["clients"] < n}) if len(set(two["urls"])) > 1 else []
    text = (f"Target: {n} servers ≥ {target}× one in req/s. Met in {len(met)} of {len(cells)} cells"
            + (": " + ", ".join(f"{a['workload']} x{a['clients']}" for a, _ in met) if met else "") + ".")
    if few:
        text += (f" With {', '.join(map(str, few))} client(s) the other server(s) get none (client i asks "
                 f"server i mod {n}), so those cells cannot gain.")
    return text


def render(one: dict, two: dict, target: float, note: str = "") -> str:
    s, n = one["settings"], served(two)
    image = (f"every request in a cell about a different random {s['image_side']}-px image, a JPEG data URI "
             "as moondream's client sends it (the server keeps no image cache: it decodes, crops and "
             "encodes every one)" if s["images"] else "no images")
    reused = sum(c.get("images_reused", 0) for r in (one, two) for c in r["cells"])
    if s["images"] and reused:
        image += (f"; but {reused} requests in all sent an image again within their cell (a load "
                  f"process's {s['images']} ran out)")
    return "\n".join([
        f"## Load: one server against {n}" + (" on Ray Serve" if two.get("replicas", 1) > 1 else "")
        + f", {two['date']}", "",
        f"Machine: {two['env'] or one['env'] or 'not recorded'}. Model: {one['model']}. "
        f"One server: `{one['command']}`. {_how(two, n)}" + (f" {note}" if note else ""), "",
        f"Each cell sends requests for {s['duration_s']:g} s (before each workload, {s['warmup_s']:g} s "
        f"untimed at the most clients), {image}. query: answers capped at {s['max_tokens']} tokens, "
        f"{s['stream']:.0%} streamed (TTFT from those); point: one object. {s['leave']:.0%} of requests "
        "leave early. req/s: requests answered in full within the cell's seconds, over them; latency: every "
        "request answered in full. *Lost*: after each cell, "
        "`/v1/stats` of every server (behind Ray Serve, of every replica) must show each request sent to it "
        "counted once (behind Ray, less clients that left waiting before a replica had their request), none "
        "live or queued, every KV page and row slot free. *Load CPU*: each load process's CPU seconds per second (near 1, "
        "the client would be what is measured).", "",
        table(one, two, target), "",
        verdict(one, two, target)])


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m bubblefree.bench.load_compare",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("one", help="the grid record against one server")
    ap.add_argument("more", help="the grid record against several")
    ap.add_argument("--target", type=float, default=1.8, help="the ratio each cell should reach")
    ap.add_argument("--note", default="", help="added to the description (how the servers ran, and why)")
    ap.add_argument("--out", default="", help="write the section into this markdown file")
    ap.add_argument("--record", default="", help="write both records here as one JSON file")
    ap.add_argument("--block", default=BLOCK, help="the markers' name in --out (<!-- NAME:begin -->)")
    args = ap.parse_args(argv)
    one, two = (json.loads(Path(p).read_text()) for p in (args.one, args.more))
    text = render(one, two, args.target, args.note)
    print(text)
    if args.out:
        write_block(Path(args.out), f"<!-- {args.block}:begin -->", f"<!-- {args.block}:end -->", text)
    if args.record:
        record: dict[str, Any] = dict(target=args.target, note=args.note, one=one, more=two)
        Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
    return text


if __name__ == "__main__":
    main()
    sys.exit(0)
