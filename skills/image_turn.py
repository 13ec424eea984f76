"""Where an image sits in a vision-language model's chat turn.

A chat template renders the user's turn with the image in it, e.g. LLaVA's
``<s>USER: <image>\\nWhat is this? ASSISTANT:``. The ids before the image
(the ``head``) are the same for every request: they belong to the image's
prefix, which the backend writes with the image's block (``ImageRef.length``
= head + block). The ids after it are the request's prompt. ``ImageTurn``
holds the head and splits a rendered turn there, refusing a turn whose
head differs or that holds the image token more than once (a user's text
that spells the placeholder).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from bubblefree.core.values import InvalidRequest


@attrs.frozen
class ImageTurn:
    token_id: int  # the model's image placeholder
    token: str  # its text, for messages
    head: tuple[int, ...]  # the ids before the image, in every turn

    @classmethod
    def of(cls, rendered: Sequence[int], token_id: int, token: str) -> ImageTurn:
        """From a turn rendered with one image (any user text)."""
        ids = [int(t) for t in rendered]
        if ids.count(token_id) != 1:
            raise ValueError(f"the chat template renders {ids.count(token_id)} image tokens "
                             f"({token!r}) for one image; one was expected")
        return cls(token_id=int(token_id), token=token, head=tuple(ids[:ids.index(token_id)]))

    def after(self, rendered: Sequence[int]) -> list[int]:
        """A turn rendered with one image -> the ids after the image."""
        ids = [int(t) for t in rendered]
        count = ids.count(self.token_id)
        if count != 1:
            raise InvalidRequest(f"prompt: holds the model's image token {self.token!r} {count} times "
                                 "(the text may not spell it)")
        at = ids.index(self.token_id)
        if tuple(ids[:at]) != self.head:
            raise InvalidRequest("prompt: the image must open the conversation, in its first user "
                                 "turn, with no message before it (a system message neither): this "
                                 "model's image prefix holds the chat template's tokens before it")
        return ids[at + 1:]

    def check_text(self, ids: Sequence[int]) -> list[int]:
        """A prompt without an image must not hold the image token either."""
        ids = [int(t) for t in ids]
        if self.token_id in ids:
            raise InvalidRequest(f"prompt: holds the model's image token {self.token!r} without an "
                                 "image (the text may not spell it)")
        return ids
