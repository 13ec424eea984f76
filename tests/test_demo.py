"""`make run`'s picture demo, on the simulated GPU with a region head: it
prints a caption, an answer, points and boxes, and both modes agree."""

from __future__ import annotations

import re

import pytest

from bubblefree import demo
from bubblefree.picture_demo import DETECT, POINT, QUESTION, drawn_picture, run
from tests.image_world import moon_engine


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
    assert "--image needs a moondream2 checkpoint" in capsys.readouterr().err
