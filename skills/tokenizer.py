"""Tokenizers as skills see them: text in, ids out, and the text of each id.

A skill sees a tokenizer only through the ``Tokenizer`` protocol, so one skill
compiles against a transformers tokenizer (``HFTokenizer``) or the small
word-level one the tests use (``skills.word_tokenizer.WordTokenizer``).

``vocab[i]`` is the text token ``i`` contributes when decoded on its own. The
path grammar runs these strings through its automaton and the spatial codec
finds its tokens by them, so special tokens must appear under their literal
names (``<loc_17>``), never as the empty string.

A tokenizer may also carry ``templates`` (``skills.templates.MoondreamTemplates``):
a model whose skills have fixed prompt ids (moondream2) rather than a chat
template. None, or absent, for text models.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, Sequence, runtime_checkable

import attrs

from bubblefree.core.values import InvalidRequest
from bubblefree.skills.image_turn import ImageTurn


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def eos_id(self) -> int: ...

    @property
    def vocab(self) -> Sequence[str]:
        """The text of each token id, decoded alone; ``len(vocab) == len(self)``."""
        ...

    def __len__(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def prompt(self, frame: str, user: str) -> list[int]:
        """A skill's prompt. ``frame`` is the raw Moondream-style text
        (``"\n\nQuestion: ...\n\nAnswer:"``); ``user`` is what a person would
        type. A tokenizer with a chat template frames ``user`` as a chat turn
        (an instruct model answers and stops only inside its own template);
        one without encodes ``frame``."""
        ...


@attrs.define
class HFTokenizer:
    """A transformers tokenizer seen through the ``Tokenizer`` protocol.

    ``wrap`` adds the tokens a spatial codec needs (``codec.location_tokens``)
    to the wrapped tokenizer itself: the model's embedding must then be
    resized to ``len(tokenizer)``, which is the backend's job. ``added``
    lists the tokens this adapter added, in id order.
    """

    hf: Any
    added: tuple[str, ...]
    add_special_tokens: bool
    _vocab: tuple[str, ...]
    _eos_id: int
    templates: Any = None  # skills.templates.MoondreamTemplates for moondream2
    image_turn: Any = None  # skills.image_turn.ImageTurn for a vision-language model
    _control: Any = attrs.field(default=None, init=False, repr=False)  # control_pattern's cache

    @classmethod
    def wrap(cls, hf: Any, *, add_tokens: Sequence[str] = (),
             add_special_tokens: bool = False, templates: Any = None,
             image_token: tuple[int, str] | None = None) -> HFTokenizer:
        """``image_token``: a vision-language model's image placeholder (id,
        text); its chat template then places the image (``image_turn``)."""
        known = hf.get_vocab()
        missing = [t for t in add_tokens if t not in known]
        if missing:
            # Special, so the model's own pre-tokenizer never splits them and
            # decode(skip_special_tokens=True) hides them from free text.
            hf.add_tokens(missing, special_tokens=True)
        if hf.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; skills need one to end outputs")
        # Decoded one by one (in one batched call): ``vocab[i]`` must be the
        # text the token adds, e.g. " M" for GPT-2's "ĠM", not its raw piece.
        vocab = tuple(hf.batch_decode([[i] for i in range(len(hf))],
                                      skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False))
        wrapped = cls(hf=hf, added=tuple(missing), add_special_tokens=add_special_tokens,
                      vocab=vocab, eos_id=int(hf.eos_token_id), templates=templates)
        if image_token is not None:
            if not getattr(hf, "chat_template", None):
                raise ValueError("a vision-language model's tokenizer needs a chat template: it "
                                 "places the image in the user's turn")
            rendered = wrapped._render([{"role": "user", "content": [{"type": "image"},
                                                                     {"type": "text", "text": "?"}]}], True)
            wrapped.image_turn = ImageTurn.of(rendered, *image_token)
        return wrapped

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab(self) -> Sequence[str]:
        return self._vocab

    def __len__(self) -> int:
        return len(self._vocab)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=self.add_special_tokens))

    def prompt(self, frame: str, user: str) -> list[int]:
        self.check_user_text(user)
        if getattr(self.hf, "chat_template", None):
            # A vision-language model's template reads the content as typed parts.
            ids = self.chat_turn(user if self.image_turn is None else [{"type": "text", "text": user}])
        else:
            ids = self.encode(frame)
        return ids if self.image_turn is None else self.image_turn.check_text(ids)

    def check_user_text(self, text: str) -> str:
        """``text`` as a caller typed it, refused if it spells one of the
        model's special tokens (``<|im_end|>``, EOS, a location token): the
        tokenizer would read it as that token, so a question could end the
        turn, or hand ``point`` ready-made coordinates. As the image token's
        refusal (``ImageTurn``), named ``prompt``."""
        if self._control is None:
            special = set(getattr(self.hf, "all_special_tokens", ()) or ())
            decoder = getattr(self.hf, "added_tokens_decoder", {}) or {}
            special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
            special |= set(self.added)
            if self.image_turn is not None:  # refused by the image turn itself, saying how often
                special.discard(self.image_turn.token)
            names = sorted((t for t in special if t and t.strip()), key=len, reverse=True)
            self._control = re.compile("|".join(map(re.escape, names))) if names else False
        found = self._control.search(text) if self._control else None
        if found:
            raise InvalidRequest(f"prompt: spells the model's special token {found.group()!r} (the text "
                                 "may not: it would enter the prompt as that token)")
        return text

    def chat_turn(self, content: Any) -> list[int]:
        """The user's turn (``content``: text, or a list of typed parts) and
        the assistant's start, through the chat template, as ids."""
        return self.chat([{"role": "user", "content": content}])

    def chat(self, turn: list[dict]) -> list[int]:
        """A conversation (``[{"role": ..., "content": ...}]``) and the
        assistant's start, through the chat template, as ids."""
        return self._render(turn, self.image_turn is not None)

    def _render(self, turn: list[dict], vision: bool) -> list[int]:
        if vision:
            # As the model's processor does: the rendered text encoded with the
            # tokenizer's special tokens (BOS) unless the template wrote them.
            text = self.hf.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
            ids = self.hf.encode(text, add_special_tokens=False)
            bos = self.hf.bos_token_id
            if bos is not None and bos not in ids and self.hf.encode("", add_special_tokens=True)[:1] == [bos]:
                ids = [bos, *ids]
            return [int(i) for i in ids]
        ids = self.hf.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer releases
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def image_prompt(self, user: str) -> list[int]:
        """The ids after the image in a turn about one image (``image_turn``)."""
        if self.image_turn is None:
            raise InvalidRequest("image: this model's tokenizer has no image turn")
        self.check_user_text(user)
        return self.image_turn.after(self.chat_turn([{"type": "image"}, {"type": "text", "text": user}]))

    def about_image(self) -> AboutImage:
        """This tokenizer as a request about an image sees it."""
        return AboutImage(self)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True,
                              clean_up_tokenization_spaces=False)


class AboutImage:
    """A vision-language model's tokenizer for one request about an image:
    ``prompt`` gives the ids after the image in the user's turn (the image's
    prefix holds the ones before it); the rest is the tokenizer's."""

    def __init__(self, inner: HFTokenizer):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def prompt(self, frame: str, user: str) -> list[int]:
        return self.inner.image_prompt(user)


def check_user_text(tokenizer: Any, text: str) -> str:
    """``tokenizer.check_user_text(text)`` where it has one (``HFTokenizer``)."""
    check = getattr(tokenizer, "check_user_text", None)
    return text if check is None else check(text)
