"""Each invariant broken by hand, and a test that catches it.

For every invariant the core keeps (I2–I9, I13), a small, realistic bug is
patched into the core's source — commit the newest step first, skip the
inflight_refs decrement, reuse a slot whose copy is in flight, append to a
finalized sequence, tear a zombie down early, release pages twice, hand a
cancelled zombie's pages or adapter slot to the next request while its step
is in flight, drop or double a result, build masks before the commit, read
the wrong row, keep a committed token from the skill, forget an image's
prefix in kv_len or the pages, drop the value kinds or the values, leave the auto mode's behind commit
unabsorbed — or into
the simulated GPU's (feed a value row's token instead of its value) — and
the exhaustive search on its quick bound must report a violation naming
what broke (an invariant id, or the simulated GPU's misuse error).

Where the core has a second guard (the I2 order check in ``commit``, the
teardown check in ``Sequence.move``), a variant removes that guard too, so
the search itself, check_integrity or the fake backend must catch the bug;
likewise, removing check_integrity's ownership check leaves a zombie's
early-released page or adapter slot to the fake's device-time check.

A patch names the exact source it replaces: when the core changes under
it, the test fails with "cannot find", never passes vacuously.
"""

from __future__ import annotations

import inspect
import re
import textwrap

import attrs
import pytest

from bubblefree.core import engine, scheduler, sequence, slots
from bubblefree.fake_backend import FakeBackend
from exhaustive import BOUNDS, search

Engine, Scheduler = engine.Engine, scheduler.Scheduler


@attrs.frozen
class Patch:
    owner: object  # a class or a module
    name: str
    edits: tuple[tuple[str, str], ...]


@attrs.frozen
class Break:
    invariant: str
    bug: str
    patches: tuple[Patch, ...]
    expect: str  # a regex the violation message must match
    modes: tuple[bool | str, ...] = (True, False)  # pipelined, blocking (or "choice"): where it must be caught
    bounds: str = "quick"  # the search bounds that must catch it


def P(owner, name, *edits):
    return Patch(owner, name, tuple(edits))


def masks_now(sched, step) -> tuple:
    """The mask ids of ``step``'s rows from the skill states as they are now."""
    states = [sched.seqs[sid] for sid in step.seq_ids]
    return tuple(None if s.state is None or s.finalized else s.state.mask_id() for s in states)


# Realistic patches a reviewer could approve: "free a cancelled request's
# pages at once", "give the adapter back when the request is done".
ZOMBIE_PAGES_BACK = P(Scheduler, "cancel", (
    "self._end(s, status, reason)", "self._end(s, status, reason); self.pages.release(s.pages); s.pages = ()"))
ADAPTER_BACK_AT_END = P(Scheduler, "_end", (
    "s.finish(status, reason)", "s.finish(status, reason)\n    if s.adapter_slot is not None: "
    "self.adapters.release((s.adapter_slot,)); s.adapter_slot = None"))
NO_OWNERS_CHECK = P(scheduler, "check_integrity", ("check_owners(sched)", "pass"))

BREAKS = [
    Break("I2", "commit the newest in-flight step first",
          (P(Scheduler, "next_commit", ("step = self.inflight[0]", "step = self.inflight[-1]")),),
          r"I2", modes=(True,)),
    Break("I2", "commit the newest first, with the core's own order check removed",
          (P(Scheduler, "next_commit", ("step = self.inflight[0]", "step = self.inflight[-1]")),
           P(Scheduler, "commit", ("if self.inflight[0] is not step:", "if False:"),
             ("self.inflight.popleft()", "self.inflight.remove(step)"))),
          r"I2|HardwareMisuse", modes=(True,)),
    Break("I3", "skip the inflight_refs decrement at commit",
          (P(Scheduler, "commit", ("s.inflight_refs -= 1", "pass")),), r"I3"),
    Break("I3", "a zombie's commit does not drop its ref",
          (P(Scheduler, "commit", ("s.inflight_refs -= 1", "s.inflight_refs -= 0 if s.finalized else 1")),),
          r"I3", modes=(True,)),
    Break("I3", "a prefill takes two refs",
          (P(Scheduler, "launched", ("s.inflight_refs += 1", "s.inflight_refs += 1 + (plan.kind is StepKind.PREFILL)")),),
          r"I3"),
    Break("I4", "a slot counts as free once the GPU is done with it",
          (P(slots.SlotPool, "free_slot", ("if slot.state is SlotState.FREE:", "if slot.state is not SlotState.LAUNCHED:")),),
          r"I4|HardwareMisuse", modes=(True,)),
    Break("I4", "the slot is released at finalize, before the commit reads it",
          (P(Scheduler, "finalized", ('self.pool.slots[step.slot].move("finalize")',
                                      'self.pool.slots[step.slot].move("finalize"); '
                                      'self.pool.slots[step.slot].state = SlotState.FREE')),),
          r"I4|HardwareMisuse"),
    Break("I5", "a zombie's commit appends its token",
          (P(Scheduler, "commit", ("if s.finalized:", "if False:")),), r"I5|IllegalTransition|KeyError",
          modes=(True,)),
    Break("I5", "EOS does not stop the sequence",
          (P(Scheduler, "_append", ('reason = ("stop" if token in req.stop_ids else "done" if done', 'reason = ("done" if done')),),
          r"I5|I8"),
    Break("I5", "the length cap is checked one token late",
          (P(Scheduler, "_append", ('else "length" if len(s.tokens) >= req.max_tokens else None)',
                                  'else "length" if len(s.tokens) > req.max_tokens else None)')),),
          r"I5|deadlock|livelock|termination"),
    Break("I6", "a zombie is torn down while a step still includes it",
          (P(Scheduler, "_maybe_teardown", ("or s.inflight_refs != 0", "")),), r"I6|IllegalTransition",
          modes=(True,)),
    Break("I6", "a zombie is torn down early, with the sequence's own guard removed",
          (P(Scheduler, "_maybe_teardown", ("or s.inflight_refs != 0", "")),
           P(sequence.Sequence, "move", ('if event == "teardown" and self.inflight_refs != 0:', "if False:"))),
          r"I3|I6|KeyError|KVCorruption|HardwareMisuse", modes=(True,)),
    Break("I6", "pages are released twice",
          (P(Scheduler, "_maybe_teardown", ("self.pages.release(s.pages)",
                                            "self.pages.release(s.pages); self.pages.release(s.pages)")),),
          r"I6|DoubleRelease"),
    Break("I6", "pages are never released",
          (P(Scheduler, "_maybe_teardown", ("self.pages.release(s.pages)", "pass")),), r"I6"),
    Break("I6", "one KV page too few is reserved",
          (P(scheduler, "pages_needed", ("prompt_len + max_tokens - 1", "prompt_len + max_tokens - 2")),),
          r"HardwareMisuse|KVCorruption"),
    # Device time (fake_backend/owners.py): the host hands a page on when it
    # plans; the device still runs a zombie's launched forward over it.
    Break("I6", "a cancelled zombie's pages go back at once, so a waiting request is admitted sooner",
          (ZOMBIE_PAGES_BACK,), r"I6: sequence \d+ \(finalized, inflight_refs=[12]\) holds pages \(\)",
          modes=(True,)),
    Break("I6", "the same, with check_integrity's ownership check removed", (ZOMBIE_PAGES_BACK, NO_OWNERS_CHECK),
          r"KVCorruption: .*KV page \d+ named for seq \d+ .* handed on while still owned", modes=(True,)),
    Break("I6", "an adapter slot is given back when its request ends, before its zombie's last step commits",
          (ADAPTER_BACK_AT_END,), r"I6: sequence \d+ \(finalized, inflight_refs=[12]\) holds .* adapter slot None",
          modes=(True,)),
    Break("I6", "the same, with check_integrity's ownership check removed", (ADAPTER_BACK_AT_END, NO_OWNERS_CHECK),
          r"KVCorruption: .*adapter slot 0 named for seq \d+ .* handed on while still owned", modes=(True,)),
    Break("I7", "a cancelled request is never answered",
          (P(Scheduler, "_end", ("self.events.append(SequenceEnded(s))",
                                "if status is not Status.CANCELLED: self.events.append(SequenceEnded(s))")),),
          r"I7"),
    Break("I7", "a request is answered twice",
          (P(Scheduler, "_end", ("self.events.append(SequenceEnded(s))",
                                "self.events.append(SequenceEnded(s)); self.events.append(SequenceEnded(s))")),),
          r"I7|KeyError"),
    Break("I7", "a cancelled request stays in the admission queue",
          (P(Scheduler, "cancel", ("self.queue.remove(seq_id)", "pass")),), r"I7|KeyError|IllegalTransition"),
    Break("I7", "a cancel from a listener leaves its end in the scheduler's outbox until the next tick",
          (P(Engine, "cancel", ("self._absorb()", "pass")),), r"I7", bounds="listeners"),
    Break("I8", "the commit reads every row's token from row 0",
          (P(Scheduler, "commit", ("output.tokens[row]", "output.tokens[0]")),), r"I8|I9|I5"),
    Break("I8", "a decode row is fed the wrong position",
          (P(Scheduler, "plan_launch", ("StepRow(s.seq_id, s.row_slot, (), s.kv_len,",
                                        "StepRow(s.seq_id, s.row_slot, (), s.kv_len + 1,")),),
          r"HardwareMisuse|KVCorruption"),
    Break("I8", "kv_len forgets the image prefix",
          (P(sequence.Sequence, "kv_len", ("return self.request.prefix_len + self.launched - 1",
                                           "return len(self.request.prompt) + self.launched - 1")),),
          r"HardwareMisuse: .*image|HardwareMisuse: .*holds the token of position"),
    Break("I6", "admission reserves pages for the prompt but not the image prefix",
          (P(Scheduler, "_admit", ("need = pages_needed(req.prefix_len, req.max_tokens, self.capacity.page_size)",
                                   "need = pages_needed(len(req.prompt), req.max_tokens, self.capacity.page_size)")),),
          r"HardwareMisuse: .*beyond its \d+ pages"),
    Break("I13", "the asked value kinds are not sent to sampling",
          (P(Scheduler, "plan_finalize", ("values=step.value_kinds)", "values=())")),),
          r"I13: sequence \d+ in step \d+: coord value None"),
    Break("I13", "the commit hands the skill no value",
          (P(Scheduler, "commit", ("value = output.values[row] if step.value_kinds else None", "value = None")),),
          r"I13: value None at index 0, asked ValueKind.COORD"),
    Break("I8", "the simulated GPU feeds a value row's token, not the value's encoding, to the next step",
          (P(FakeBackend, "finalize", ("inputs.append(token if kind is None else value_marker(kind, value))",
                                      "inputs.append(token)")),),
          r"I8: request \d+ (got|partial)|skill: .* the model says"),
    Break("I9", "masks are built at launch, before the previous step's commit",
          (P(Scheduler, "launched", ("self.inflight.append(step)",
                                     "self.inflight.append(step); step.mask_ids = MASKS_NOW(self, step)")),
           P(Scheduler, "plan_finalize", ("step.mask_ids = tuple(masks)", "step.mask_ids = step.mask_ids or tuple(masks)"))),
          r"I9", modes=(True,)),
    Break("skill", "the token that reaches max_tokens is not fed to the skill (the request ends anyway)",
          (P(Scheduler, "_append", ('done, error = (False, None) if s.state is None else guarded(',
                                    'done, error = (False, None) if s.state is None or len(s.tokens) >= '
                                    'req.max_tokens else guarded(')),),
          r"skill: .* received \(\(\d+, \d+\), .*\), committed \[?\(?\d+, \d+, \d+"),
    # Auto's behind branch commits at a tick's end: an end it leaves
    # unabsorbed reaches no one once the engine has nothing left to do.
    Break("I7", "the behind commit's events are not absorbed",
          (P(Engine, "tick", ("progress = self._commit() or progress\nself._absorb()\nself._learn()",
                              "progress = self._commit() or progress\nself._learn()")),),
          r"I7", modes=("choice",)),
    Break("I9", "the mask is not sent to sampling",
          (P(Scheduler, "plan_finalize", ('mask, error = guarded(s.request, "mask_id", lambda: integer(s.state.mask_id()))',
                                         "mask, error = None, None")),), r"I9"),
]


def _edit(src: str, old: str, new: str, name: str) -> str:
    """Replace ``old`` (one line's text, or whole lines) once; lines of ``new``
    take the indentation of the first line replaced."""
    if "\n" not in old:
        if src.count(old) != 1:
            pytest.fail(f"{name}: cannot find {old!r} exactly once; the core changed, update this break")
        return src.replace(old, new)
    lines, want = src.splitlines(), [w.strip() for w in old.splitlines()]
    starts = [i for i in range(len(lines)) if [x.strip() for x in lines[i:i + len(want)]] == want]
    if len(starts) != 1:
        pytest.fail(f"{name}: cannot find {old!r} exactly once; the core changed, update this break")
    i = starts[0]
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i:i + len(want)] = [indent + w.strip() for w in new.splitlines()]
    return "\n".join(lines) + "\n"


def apply(monkeypatch, patch: Patch) -> None:
    fn = getattr(patch.owner, patch.name)
    code = fn.fget if isinstance(fn, property) else fn  # a property's source keeps its decorator
    src = textwrap.dedent(inspect.getsource(code))
    for old, new in patch.edits:
        src = _edit(src, old, new, patch.name)
    namespace: dict = {}
    scope = dict(code.__globals__, MASKS_NOW=masks_now)
    exec(compile(src, f"<broken {patch.name}>", "exec"), scope, namespace)
    monkeypatch.setattr(patch.owner, patch.name, namespace[patch.name])


@pytest.mark.parametrize("brk", BREAKS, ids=[f"{b.invariant}-{b.bug.replace(' ', '_')}" for b in BREAKS])
def test_a_broken_invariant_is_caught(brk, monkeypatch):
    for patch in brk.patches:
        apply(monkeypatch, patch)
    for pipelined in brk.modes:
        report = search(BOUNDS[brk.bounds], pipelined, max_violations=1)
        mode = {True: "pipelined", False: "blocking"}.get(pipelined, pipelined)
        assert report.violations, f"{brk.invariant} ({brk.bug}) went unnoticed in {mode} mode: {report.line()}"
        message, path = report.violations[0]
        assert re.search(brk.expect, message), f"caught, but as {message!r} (path {path})"


def test_every_core_invariant_has_a_break():
    assert {b.invariant for b in BREAKS} == {f"I{i}" for i in (*range(2, 10), 13)} | {"skill"}


def test_the_patches_leave_the_core_intact():
    # Each break takes effect while applied, and monkeypatch puts back the
    # very function objects afterwards: the quick search is clean again.
    originals = {(p.owner, p.name): getattr(p.owner, p.name) for b in BREAKS for p in b.patches}
    for brk in BREAKS:
        with pytest.MonkeyPatch.context() as mp:
            for patch in brk.patches:
                apply(mp, patch)
            assert all(getattr(p.owner, p.name) is not originals[p.owner, p.name] for p in brk.patches), brk.bug
        assert all(getattr(owner, name) is fn for (owner, name), fn in originals.items()), brk.bug
    report = search(BOUNDS["quick"], True)
    assert not report.violations, report.violations[:1]
