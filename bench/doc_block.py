"""A benchmark's section of a document, between its own markers: a new run
replaces that section and leaves the rest (earlier runs, other benchmarks)."""

from __future__ import annotations

from pathlib import Path


def write_block(path: Path, begin: str, end: str, text: str, title: str = "# Speed benchmarks") -> None:
    doc = path.read_text() if path.exists() else f"{title}\n"
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(doc)
