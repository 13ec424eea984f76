"""moondream's prompts: its skills' template token ids around the user's text.

A text model frames a skill's prompt through its tokenizer (a chat template,
or the raw ``frame``; ``Tokenizer.prompt``). moondream2 has no chat
template: each skill has fixed token ids around the user's words, stored in
its config (``cuda_backend/moondream/config.py``, ``TokenizerConfig``):

    query     prefix + encode(question) + suffix     "\\n\\nQuestion:" ... "\\n\\nAnswer:"
    caption   one template per length               "\\n\\nShort caption:" and friends
    point     prefix + encode(" " + object) + suffix  "\\n\\nPoint:" ... "\\n\\n"
    detect    prefix + encode(" " + object) + suffix  "\\n\\nDetect:" ... "\\n\\n"

After an image, the prompt follows the image prefix (which begins with
BOS); a request without an image begins with BOS itself, as moondream's
reference does for a text-only query. Caption, point and detect ask about an
image: without one they are refused (``requires_image``).

A tokenizer that carries ``templates`` (an attribute, None or absent for text
models) makes the built-in skills use them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import attrs

from bubblefree.core.values import PromptValue
from bubblefree.skills.spatial_refs import place
from bubblefree.skills.tokenizer import Tokenizer, check_user_text

# The texts behind moondream2's template ids (GPT-2 BPE), for tokenizers that
# have no ids of their own for them (tests' small tokenizers).
TEXTS = {
    "caption": {"short": "\n\nShort caption:", "normal": "\n\nCaption:", "long": "\n\nLong caption:"},
    "query": {"prefix": "\n\nQuestion:", "suffix": "\n\nAnswer:"},
    "detect": {"prefix": "\n\nDetect:", "suffix": "\n\n"},
    "point": {"prefix": "\n\nPoint:", "suffix": "\n\n"},
}

IMAGE_SKILLS = frozenset({"caption", "point", "detect"})


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in value)


@attrs.frozen
class MoondreamTemplates:
    bos_id: int
    query: tuple[tuple[int, ...], tuple[int, ...]]  # prefix, suffix
    captions: Mapping[str, tuple[int, ...]] = attrs.field(
        hash=False, converter=lambda m: MappingProxyType({k: _ids(v) for k, v in m.items()}))
    point: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    detect: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # The placeholders a spatial reference's values replace (skills.spatial_refs);
    # older moondream2 configs name none, and then take no spatial_refs.
    coord_id: int | None = None
    size_id: int | None = None

    @classmethod
    def from_ids(cls, bos_id: int, templates: Mapping[str, Any], coord_id: int | None = None,
                 size_id: int | None = None) -> MoondreamTemplates:
        """From a config's ``templates`` (moondream's layout: ``{"query":
        {"prefix": [...], "suffix": [...]}, "caption": {"short": [...], ...},
        "detect": {...}, "point": {...}}``)."""
        def pair(skill: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
            part = templates[skill]
            return _ids(part["prefix"]), _ids(part["suffix"])
        return cls(bos_id=int(bos_id), query=pair("query"), captions=templates["caption"],
                   point=pair("point"), detect=pair("detect"),
                   coord_id=None if coord_id is None else int(coord_id),
                   size_id=None if size_id is None else int(size_id))

    @classmethod
    def from_text(cls, tokenizer: Tokenizer, bos_id: int, coord_id: int | None = None,
                  size_id: int | None = None) -> MoondreamTemplates:
        """The same prompts spelled in ``tokenizer``'s own ids."""
        enc = tokenizer.encode
        ids = {skill: {part: enc(text) for part, text in parts.items()} for skill, parts in TEXTS.items()}
        return cls.from_ids(bos_id, ids, coord_id, size_id)

    @staticmethod
    def requires_image(skill: str) -> bool:
        return skill in IMAGE_SKILLS

    def query_prompt(self, tokenizer: Tokenizer, question: str) -> list[int]:
        return self.referring_query(tokenizer, question, ())[0]

    def referring_query(self, tokenizer: Tokenizer, question: str,
                        refs: tuple) -> tuple[list[int], tuple[PromptValue, ...]]:
        """The query's ids with the spatial references' placeholders after
        the prefix, and the values those positions take."""
        prefix, suffix = self.query
        marks, values = place(refs, len(prefix), self.coord_id, self.size_id) if refs else ([], ())
        return [*prefix, *marks, *tokenizer.encode(check_user_text(tokenizer, question)), *suffix], values

    @property
    def takes_spatial_refs(self) -> bool:
        return self.coord_id is not None and self.size_id is not None

    def caption_prompt(self, length: str) -> list[int] | None:
        """The length's template, or None when this model has none for it."""
        ids = self.captions.get(length)
        return None if ids is None else list(ids)

    def object_prompt(self, tokenizer: Tokenizer, skill: str, obj: str) -> list[int]:
        prefix, suffix = self.point if skill == "point" else self.detect
        return [*prefix, *tokenizer.encode(" " + check_user_text(tokenizer, obj)), *suffix]


def templates_of(tokenizer: Tokenizer) -> MoondreamTemplates | None:
    return getattr(tokenizer, "templates", None)
