"""Skill names to skills. Adding a skill: one new file, one line below.

A ``Registry`` is an immutable value (no module-level mutation): a
deployment with its own skills builds ``BUILTIN.with_skill(MySkill())`` and
hands it to its ``SkillSet``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import attrs

from bubblefree.core.values import InvalidRequest, named, shown
from bubblefree.skills.base import Skill
from bubblefree.skills.complete import Complete
from bubblefree.skills.detect import Detect
from bubblefree.skills.point import Point
from bubblefree.skills.segment import Segment
from bubblefree.skills.text import Caption, Query
from bubblefree.skills.yesno import YesNo


@attrs.frozen
class Registry:
    skills: Mapping[str, Skill] = attrs.field(converter=lambda m: MappingProxyType(dict(m)))

    @skills.validator
    def _named(self, _, skills: Mapping[str, Skill]) -> None:
        for name, skill in skills.items():
            if bad_name(name) is not None or name != getattr(skill, "name", None):
                raise ValueError(f"a skill is registered under its name, a non-empty str: {shown(name)} "
                                 f"holds {type(skill).__name__} named {shown(getattr(skill, 'name', None))}")

    @classmethod
    def of(cls, *skills: Skill) -> Registry:
        return cls({}).with_skill(*skills)

    def with_skill(self, *skills: Skill) -> Registry:
        merged = dict(self.skills)
        for skill in skills:
            if not isinstance(skill, Skill):  # else the engine's build failed on a missing hook, unnamed
                raise ValueError(f"a skill must be a Skill (skills.base), got {type(skill).__name__}")
            why = bad_name(skill.name)
            if why is not None:
                raise ValueError(f"a skill's name {why}, got {shown(skill.name)} "
                                 f"({type(skill).__name__})")
            if skill.name in merged:
                raise ValueError(f"a skill named {skill.name!r} is already registered")
            merged[skill.name] = skill
        return Registry(merged)

    def get(self, name: str) -> Skill:
        skill = self.skills.get(name) if isinstance(name, str) else None
        if skill is None:
            raise InvalidRequest(f"skill: unknown skill {shown(name)}; known: "
                                 f"{', '.join(sorted(map(named, self.skills)))}")
        return skill

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.skills)


# A name is what callers send and what refusals quote: short and printable.
NAME_CHARS = 64


def bad_name(name: object) -> str | None:
    """Why ``name`` cannot name a skill, or None."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty str"
    if len(name) > NAME_CHARS or name != name.strip() or not name.isprintable():
        return f"must be at most {NAME_CHARS} printable characters, without spaces around them"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: a refusal quoting it could not be printed
        return "must be valid text (a lone surrogate is not)"
    return None


BUILTIN = Registry.of(
    Query(),
    Caption(),
    Point(),
    Detect(),
    Segment(),
    YesNo(),
    Complete(),
)
