"""The SVG path grammar: its automaton, its compilation over token strings,
and rendering paths that stay inside their bbox."""

from __future__ import annotations

import re

from hypothesis import example, given, strategies as st

from bubblefree.skills import Kind, LocationCodec, SkillSet, WordTokenizer, demo_tokenizer, location_tokens
from bubblefree.skills.driver import MaskRecorder
from bubblefree.skills.path_grammar import NUM, PATH_DFA, Command
from bubblefree.skills.segment import render_path

TOK = demo_tokenizer()
MASKS = MaskRecorder()
SKILLS = SkillSet(TOK, MASKS.register)
PATH = SKILLS.tables("segment").path
STATE = {name: i for i, name in enumerate(PATH_DFA.names)}

# The language, written independently as a regex over symbols ("#" = NUM).
REFERENCE = re.compile(r" ?M##(?: ?(?:L##|C######|M##|Z ?M##))*(?: ?Z)?")


def words(state):
    return {TOK.vocab[t] for t in MASKS.allowed(PATH.masks[STATE[state]])
            if not TOK.vocab[t].startswith("<loc_")}


def test_allowed_sets_per_state():
    assert words("start") == {"M", " M", " "}
    assert words("cmd") == {"M", "L", "C", "Z", " M", " L", " C", " Z", "Z M", " ", "<eos>"}
    assert words("after_z") == {"M", " M", " ", "<eos>"}
    for state in ("M0", "M1", "L0", "C5"):
        allowed = MASKS.allowed(PATH.masks[STATE[state]])
        assert allowed == SKILLS.codec.ids(Kind.X)  # numbers only: no EOS mid-command
    # Text spellings of a location, and tokens that break a command, never pass.
    everywhere = set().union(*(words(s) for s in STATE))
    assert not everywhere & {"<", "loc", "M0", "ML", "LL", "<size_0>"}


def test_tokens_spanning_symbols_land_where_their_last_symbol_does():
    z_m = TOK.vocab.index("Z M")
    assert PATH.trans[STATE["cmd"]][z_m] == STATE["M0"]
    assert z_m not in PATH.trans[STATE["after_z"]]


def test_empty_tokens_are_never_allowed():
    tok = WordTokenizer.build(("", "M", "L") + location_tokens(4, 2))
    masks = MaskRecorder()
    skills = SkillSet(tok, masks.register, codec=LocationCodec.for_tokenizer(
        tok, coord_bins=4, size_bins=2))
    path = skills.tables("segment").path
    assert all(2 not in masks.allowed(m) for m in path.masks)  # id 2 is ""


symbols = st.sampled_from([" ", "M", "L", "C", "Z", "#"])
command = st.sampled_from(["L##", "C######", "M##", "Z M##", "ZM##"])
grammatical = st.builds(lambda sp, rest, z: sp + "M##" + "".join(rest) + z,
                        st.sampled_from(["", " "]),
                        st.lists(st.tuples(st.sampled_from(["", " "]), command)
                                 .map("".join), max_size=5),
                        st.sampled_from(["", "Z", " Z", " ", "Z ", "L#"]))


@given(st.one_of(st.lists(symbols, max_size=14).map("".join), grammatical))
@example("M## ")
@example("M##Z ")
@example("M##ZL##")
def test_the_automaton_accepts_exactly_the_reference_language(text):
    syms = [NUM if c == "#" else c for c in text]
    end = PATH_DFA.run(PATH_DFA.start, syms)
    assert (end in PATH_DFA.accepting) == bool(REFERENCE.fullmatch(text))


coords = st.floats(0.0, 1.0)


ARITY = {"M": 2, "L": 2, "C": 6, "Z": 0}
commands = st.sampled_from(sorted(ARITY)).flatmap(
    lambda c: st.tuples(st.just(c), st.lists(coords, min_size=ARITY[c], max_size=ARITY[c])))


@given(st.tuples(coords, coords, coords, coords), st.lists(commands, max_size=6))
def test_rendered_paths_stay_inside_their_bbox(box, cmds):
    x0, x1 = sorted(box[:2])
    y0, y1 = sorted(box[2:])
    bbox = {"x_min": round(x0, 6), "x_max": round(x1, 6), "y_min": round(y0, 6), "y_max": round(y1, 6)}
    d = render_path([Command(c, tuple(a)) for c, a in cmds], bbox)
    nums = [float(p) for p in d.split() if p not in "MLCZ"]
    assert len(nums) == sum(len(a) for _, a in cmds)
    assert all(bbox["x_min"] <= x <= bbox["x_max"] for x in nums[0::2])
    assert all(bbox["y_min"] <= y <= bbox["y_max"] for y in nums[1::2])
