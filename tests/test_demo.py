"""`make run`'s picture demo, on the simulated GPU with a region head: it
prints a caption, an answer, points and boxes, and both modes agree."""

from __future__ import annotations

import re
import tempfile

import pytest

from bubblefree import demo
from bubblefree.picture_demo import DETECT, POINT, QUESTION, drawn_picture, run
from tests.image_world import moon_engine, tiny_checkpoint


def test_the_picture_demo_answers_about_the_picture(capsys):
    engine = moon_engine()
    try:
        assert run(engine, drawn_picture(), max_tokens=12, rounds=1)
    finally:
        engine.close()
    out = capsys.readouterr().out
    assert out.startswith("Caption: ") and f"Q: {QUESTION}\nA: " in out
    number = r"0\.\d{3}|1\.000"
    assert re.search(rf"Point at {POINT!r}: (\(({number}), ({number})\)(, )?)+\n", out)
    assert re.search(rf"Detect {DETECT!r}: (\[({number}), ({number}), ({number}), ({number})\](, )?)+\n", out)
    assert re.search(r"\| pipelined \| 4 \| \d+ \| [\d.]+ \| yes \|", out)
    assert re.search(r"\| blocking \| 4 \| \d+ \| [\d.]+ \| yes \|", out)


def test_an_image_without_a_moondream_checkpoint_is_refused(monkeypatch, capsys):
    monkeypatch.delenv("BUBBLEFREE_MODEL", raising=False)
    with pytest.raises(SystemExit):
        demo.main(["--image", "photo.jpg"])
    assert "--image needs a moondream2 or LLaVA checkpoint" in capsys.readouterr().err


def test_make_run_with_a_moondream_checkpoint_in_the_environment(tmp_path, monkeypatch, capsys):
    """``BUBBLEFREE_MODEL=/path make run``: a checkpoint directory (the tiny
    config, random weights: its answers are noise) answers about the drawn
    picture through the real backend, on the CPU here."""
    monkeypatch.setenv("BUBBLEFREE_MODEL", str(tiny_checkpoint(tmp_path, seed=1)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the drawn picture is saved
    assert demo.main(["--max-tokens", "4", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert f"loading {tmp_path}" in out
    assert f"the picture: {tmp_path / 'bubblefree-picture.png'}" in out
    for line in ("Caption: ", f"Q: {QUESTION}", f"Point at {POINT!r}: ", f"Detect {DETECT!r}: ",
                 "| pipelined | 4 |", "| blocking | 4 |"):
        assert line in out


def test_make_run_with_a_llava_checkpoint_asks_what_it_serves(tmp_path, monkeypatch, capsys):
    """A transformers VLM checkpoint (tiny LLaVA, random weights): caption
    and query about the picture, in both modes; no point or detect (no
    region head, no location tokens)."""
    from tests.vlm_world import checkpoint

    monkeypatch.setenv("BUBBLEFREE_MODEL", str(checkpoint(tmp_path / "llava", seed=1)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert demo.main(["--max-tokens", "4", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for line in ("Caption: ", f"Q: {QUESTION}", "| pipelined | 2 |", "| blocking | 2 |"):
        assert line in out
    assert "Point at" not in out and "Detect" not in out
