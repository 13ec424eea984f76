"""Skills: small decode state machines that never see a tensor.

    skills = SkillSet(tokenizer, engine.register_mask)   # compile once
    request = skills.request("detect", object="cat", max_objects=5)
    handle = engine.submit(request)

See docs/skills.md for the contract and how to add a skill.
"""

from bubblefree.skills.base import Skill, SkillError, SkillState
from bubblefree.skills.codec import Kind, LocationCodec, RegionHeadCodec, SpatialCodec, location_tokens
from bubblefree.skills.registry import BUILTIN, Registry
from bubblefree.skills.skillset import SkillSet, build_request
from bubblefree.skills.text import TextStream
from bubblefree.skills.tokenizer import HFTokenizer, Tokenizer
from bubblefree.skills.word_tokenizer import WordTokenizer, demo_tokenizer

__all__ = [
    "BUILTIN", "HFTokenizer", "Kind", "LocationCodec", "Registry", "RegionHeadCodec",
    "Skill", "SkillError", "SkillSet", "SkillState", "SpatialCodec", "TextStream",
    "Tokenizer", "WordTokenizer", "build_request", "demo_tokenizer", "location_tokens",
]
