"""A tiny word-level tokenizer: the fake backend's vocabulary in tests and
benchmarks, small enough that expected outputs are computable by hand.

Text splits on whitespace; an unknown word is ``<unk>``. Decoding joins
words with single spaces. Ids are positions in ``words``; ``<eos>`` and
``<unk>`` come first. Some entries hold several path symbols ("Z M",
" L") so the path grammar is tested on tokens that span commands.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import attrs

from bubblefree.skills.codec import location_tokens

DEMO_WORDS = (
    "Question:", "Answer:", "Answer", "Describe", "this", "image", "image.", "in", "one",
    "sentence.", "detail.", "Point:", "Detect:", "Segment:", "yes", "no", "Yes", "No", "or",
    "no.", "the", "a", "cat", "dog", "cats", "dogs", "sits", "on", "mat", "red", "blue", "car",
    "is", "there", "how", "many", "what", "colour", "of", "and", "two", "three", "left",
    "right", "sky", "tree", "person", ".", ",",
    # Path grammar pieces, including tokens that span symbols.
    "M", "L", "C", "Z", " M", " L", " C", " Z", "Z M", "ML", "LL", " ", "<", "loc", "M0",
)


@attrs.frozen
class WordTokenizer:
    words: tuple[str, ...] = attrs.field(converter=tuple)
    # skills.templates.MoondreamTemplates: the skills prompt as moondream2's do
    templates: Any = attrs.field(default=None, eq=False)
    _index: dict[str, int] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.words[:2] != ("<eos>", "<unk>"):
            raise ValueError("words must begin with '<eos>', '<unk>'")
        index: dict[str, int] = {}
        for i, w in enumerate(self.words):
            index.setdefault(w, i)
        object.__setattr__(self, "_index", index)

    @classmethod
    def build(cls, words: Iterable[str]) -> WordTokenizer:
        return cls(("<eos>", "<unk>") + tuple(words))

    @property
    def eos_id(self) -> int:
        return 0

    @property
    def unk_id(self) -> int:
        return 1

    @property
    def vocab(self) -> Sequence[str]:
        return self.words

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, text: str) -> list[int]:
        return [self._index.get(w, self.unk_id) for w in text.split()]

    def prompt(self, frame: str, user: str) -> list[int]:
        return self.encode(frame)

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[i] for i in ids if i != self.eos_id)


def demo_tokenizer(*, filler: int = 0, coord_bins: int = 1024,
                   size_bins: int = 64) -> WordTokenizer:
    """``DEMO_WORDS``, ``filler`` extra words ("w0", "w1", …) to grow the
    vocabulary, then the location tokens of ``LocationCodec``."""
    return WordTokenizer.build(DEMO_WORDS + tuple(f"w{i}" for i in range(filler))
                               + location_tokens(coord_bins, size_bins))
