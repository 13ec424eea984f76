"""The SVG path grammar of ``segment``, as a finite automaton over tokens.

Paths use absolute commands only: ``M x y``, ``L x y``, ``C x1 y1 x2 y2 x y``
and ``Z``; a path starts with ``M``, and after ``Z`` only ``M`` may follow.
Command letters are text (whatever tokens spell them: "M", " L", "Z M", …);
numbers are spatial coordinate tokens, each one symbol ``NUM``, so a number
is always one whole token, always parseable, and its value always in [0, 1]
(relative to the bbox, which keeps the outline inside it). One optional
space may precede a command letter, because many tokenizers glue a space to
the word. Accepting states (EOS allowed) are those after a whole command.

Compilation runs once per tokenizer: each token's symbol string is run
through the automaton from each state; the tokens that keep it alive are
that state's allowed set, and where each lands is the state's transition
table. A token is pre-filtered by its first symbol, so a 150k vocabulary
compiles in a fraction of a second. Per step the state is just an int.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from bubblefree.skills.base import CompileContext
from bubblefree.skills.codec import Kind, SpatialCodec

NUM = "<num>"  # a coordinate token; never one character, so never text
ARITY = {"M": 2, "L": 2, "C": 6, "Z": 0}


@attrs.frozen
class PathDFA:
    names: tuple[str, ...]
    delta: Mapping[tuple[int, str], int]
    start: int
    accepting: frozenset[int]

    def run(self, state: int, symbols: Sequence[str]) -> int | None:
        for sym in symbols:
            nxt = self.delta.get((state, sym))
            if nxt is None:
                return None
            state = nxt
        return state

    def first_symbols(self, state: int) -> frozenset[str]:
        return frozenset(sym for (s, sym) in self.delta if s == state)


def build_path_dfa() -> PathDFA:
    names = ["start", "start_sp", "cmd", "cmd_sp", "after_z", "after_z_sp"]
    names += [f"{c}{i}" for c, n in ARITY.items() for i in range(n)]
    at = {n: i for i, n in enumerate(names)}
    delta: dict[tuple[int, str], int] = {}

    def letter(src: str, c: str) -> None:
        delta[(at[src], c)] = at["after_z"] if c == "Z" else at[f"{c}0"]

    delta[(at["start"], " ")] = at["start_sp"]
    for src in ("start", "start_sp", "after_z", "after_z_sp"):
        letter(src, "M")  # a path, and a subpath after Z, begins with a move
    delta[(at["after_z"], " ")] = at["after_z_sp"]
    delta[(at["cmd"], " ")] = at["cmd_sp"]
    for src in ("cmd", "cmd_sp"):
        for c in ARITY:
            letter(src, c)
    for c, n in ARITY.items():
        for i in range(n):
            delta[(at[f"{c}{i}"], NUM)] = at[f"{c}{i + 1}"] if i + 1 < n else at["cmd"]
    return PathDFA(names=tuple(names), delta=delta, start=at["start"],
                   accepting=frozenset({at["cmd"], at["after_z"]}))


PATH_DFA = build_path_dfa()


@attrs.frozen
class PathTables:
    dfa: PathDFA
    masks: tuple[int, ...]  # mask id per DFA state
    trans: tuple[Mapping[int, int], ...]  # per DFA state: allowed token -> next state
    num_ids: frozenset[int]
    vocab: Sequence[str] = attrs.field(repr=False)


def symbols_of(token: int, vocab: Sequence[str], num_ids: frozenset[int]) -> tuple[str, ...]:
    return (NUM,) if token in num_ids else tuple(vocab[token])


def compile_path(ctx: CompileContext, num_ids: frozenset[int],
                 dfa: PathDFA = PATH_DFA) -> PathTables:
    vocab = ctx.tokenizer.vocab
    alphabet = {sym for (_, sym) in dfa.delta}
    by_first: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
    for tok in range(len(vocab)):
        if tok == ctx.eos_id:
            continue  # EOS is the end marker, allowed in accepting states only
        syms = symbols_of(tok, vocab, num_ids)
        # An empty token would keep any state alive forever; never allow it.
        if syms and syms[0] in alphabet:
            by_first.setdefault(syms[0], []).append((tok, syms))
    masks, trans = [], []
    for state in range(len(dfa.names)):
        table: dict[int, int] = {}
        for first in dfa.first_symbols(state):
            for tok, syms in by_first.get(first, ()):
                end = dfa.run(state, syms)
                if end is not None:
                    table[tok] = end
        allowed = frozenset(table) | (frozenset({ctx.eos_id}) if state in dfa.accepting
                                      else frozenset())
        masks.append(ctx.mask(allowed))
        trans.append(table)
    return PathTables(dfa=dfa, masks=tuple(masks), trans=tuple(trans),
                      num_ids=num_ids, vocab=vocab)


@attrs.frozen
class Command:
    letter: str
    args: tuple[float, ...]  # relative coordinates, x and y alternating


def whole_commands(tables: PathTables, codec: SpatialCodec,
                   items: Sequence[tuple[int, float | None]]) -> list[Command]:
    """Parse committed (token, value) pairs into commands; a command cut short
    by the budget is dropped, so the path is always well formed."""
    dfa = tables.dfa
    state, out = dfa.start, []
    letter: str | None = None
    args: list[float] = []
    for token, value in items:
        for sym in symbols_of(token, tables.vocab, tables.num_ids):
            state = dfa.delta[(state, sym)]  # every committed token passed trans
            if sym == NUM:
                kind = Kind.X if len(args) % 2 == 0 else Kind.Y
                args.append(codec.decode(kind, token, value))
            elif sym in ARITY:
                letter, args = sym, []
            if letter is not None and state in dfa.accepting:
                out.append(Command(letter, tuple(args)))
                letter = None
    return out
