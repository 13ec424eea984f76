"""Device memory: the paged KV cache and the per-row-slot sampled tokens.

The fake stores no tensors, only who wrote each KV position:
``(page, offset) -> Entry(seq_id, position, token, is_prompt)``. A forward
writes its rows' inputs through their page tables, then — as attention
would — reads every earlier position of the row back through the same
pages. Any entry that is missing, another sequence's, or another position's
means the page table is wrong or a page was handed out while still owned
(I6), and raises ``KVCorruption``. The model's prompt is the one read back,
so the engine cannot get a right answer from a wrong cache.

``row_tokens[row_slot]`` is what sampling last wrote for that slot. A decode
row's input comes from there, never from the host (the seed's central move),
in compute-queue order: it must be the token of exactly the position the row
decodes, so reading it before its sampling was enqueued is caught. After a
row that decoded a value, sampling writes the value's marker there instead
(the region encoder's output on a GPU; ``images.py``).

An IMAGE_PREFILL row writes its image's markers as prompt entries at the
prefix positions, then its prompt, through the same page table.
"""

from __future__ import annotations

import attrs

from bubblefree.core.values import StepKind, StepPlan, StepRow
from bubblefree.fake_backend.errors import HardwareMisuse, KVCorruption
from bubblefree.fake_backend.images import fingerprint, image_markers, with_values


@attrs.frozen
class Entry:
    seq_id: int
    position: int
    token: int
    is_prompt: bool


@attrs.frozen
class Context:
    """What one row's forward hands to sampling (its 'logits')."""

    seq_id: int
    row_slot: int
    prompt: tuple[int, ...]
    position: int  # of the token to be sampled
    prev_token: int


@attrs.define
class DeviceMemory:
    page_size: int
    kv: dict[tuple[int, int], Entry] = attrs.Factory(dict)
    row_tokens: dict[int, Entry] = attrs.Factory(dict)

    def forward(self, plan: StepPlan) -> tuple[dict[tuple[int, int], Entry], tuple[Context, ...]]:
        """Run a forward without touching memory: return its KV writes and
        contexts, so a raise leaves the device as it was. The caller applies
        the writes with ``store``."""
        writes: dict[tuple[int, int], Entry] = {}
        for row in plan.rows:
            for entry in self._inputs(row, plan):
                writes[self._addr(row, entry.position)] = entry
        return writes, tuple(self._read_back(row, writes) for row in plan.rows)

    def store(self, writes: dict[tuple[int, int], Entry]) -> None:
        self.kv.update(writes)

    def sampled(self, ctx: Context, next_input: int) -> None:
        """Sampling writes the row's next input on the device (in compute
        order): its token, or the marker of the value it decoded."""
        self.row_tokens[ctx.row_slot] = Entry(ctx.seq_id, ctx.position, next_input, False)

    def _addr(self, row: StepRow, position: int) -> tuple[int, int]:
        return row.pages[position // self.page_size], position % self.page_size

    def _inputs(self, row: StepRow, plan: StepPlan) -> list[Entry]:
        if plan.kind is not StepKind.DECODE:
            prefix = () if row.image is None else image_markers(image_source(row, plan), row.image.length)
            text = with_values(row.tokens, row.prompt_values)
            return [Entry(row.seq_id, row.position + i, tok, True) for i, tok in enumerate(prefix + text)]
        held = self.row_tokens.get(row.row_slot)
        where = f"step {plan.step_id}: decode row of seq {row.seq_id} at position {row.position}"
        if held is None:
            raise HardwareMisuse(f"{where} reads row_slot {row.row_slot}, where no token was ever sampled")
        if held.seq_id != row.seq_id:
            raise HardwareMisuse(f"{where} reads row_slot {row.row_slot}, which holds seq {held.seq_id}'s "
                                 f"token: the row slot was handed to another sequence while in use")
        if held.position != row.position:
            raise HardwareMisuse(f"{where} reads row_slot {row.row_slot}, which holds the token of position "
                                 f"{held.position}: the sampling that produces its input was not enqueued "
                                 f"before this forward (or the position is wrong)")
        return [Entry(row.seq_id, row.position, held.token, False)]

    def _read_back(self, row: StepRow, writes: dict[tuple[int, int], Entry]) -> Context:
        last = row.position + row.num_tokens - 1
        prompt: list[int] = []
        prev = -1
        for pos in range(last + 1):
            addr = self._addr(row, pos)
            entry = writes.get(addr) or self.kv.get(addr)
            if entry is None or entry.seq_id != row.seq_id or entry.position != pos:
                found = "nothing" if entry is None else f"seq {entry.seq_id} position {entry.position}"
                raise KVCorruption(
                    f"seq {row.seq_id}: KV of position {pos} at page {addr[0]} offset {addr[1]} holds "
                    f"{found}: wrong page table, or the page was reused while still owned (I6)")
            if entry.is_prompt:
                if len(prompt) != pos:
                    raise KVCorruption(f"seq {row.seq_id}: prompt KV at position {pos} after generated KV")
                prompt.append(entry.token)
            prev = entry.token
        if not prompt:
            raise KVCorruption(f"seq {row.seq_id}: no prompt in the KV")
        return Context(row.seq_id, row.row_slot, tuple(prompt), last + 1, prev)


def image_source(row: StepRow, plan: StepPlan) -> int:
    """The fingerprint of a row's image; a source the fake cannot read is the
    engine's misuse (on a GPU: encoding garbage), raised before any write."""
    try:
        return fingerprint(row.image.source)
    except TypeError as err:
        raise HardwareMisuse(f"step {plan.step_id}: row of seq {row.seq_id}: image source: {err}") from None
