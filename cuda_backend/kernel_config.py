"""What runs inside a decode step, as one frozen value chosen when the
backend is built: the attention kernels' dispatch, where rotary, the KV
write and Phi's MLP activation run, and the GEMM tiles. ``CudaBackend``
builds a ``KernelConfig`` once (by default ``KernelConfig.measured`` for its
device) and passes it down to the runner, the fused decoder and the
attention context; custom ops receive only the scalars they need
(``Dispatch.scalars``, ``TileTable.scalars``). Nothing here is mutable, so
two backends with different configs can share a process.

Launch settings are written as short strings (``1x16w1s3``,
``64n128k4s4w3p``), as benchmarks and tuning tools name them. The measured
defaults: ``measured.py``; how they were measured: docs/performance.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch


def parse_settings(cls, pattern: str, what: str, expected: str, text: str,
                   powers_of_two: tuple[str, ...], shown: str | None = None):
    """``cls`` from the integers ``pattern`` captures in ``text``; a clear
    error naming ``shown`` (what the caller wrote; ``text`` by default)
    when it does not match or when a field in ``powers_of_two`` is not
    one."""
    text, shown = text.strip(), text if shown is None else shown
    m = re.fullmatch(pattern, text)
    if m is None:
        raise ValueError(f"{what} {shown!r}: expected {expected}")
    out = cls(*(int(g) for g in m.groups() if g is not None))  # a trailing optional: its default
    for name in powers_of_two:
        n = getattr(out, name)
        if n < 1 or n & (n - 1):
            raise ValueError(f"{what} {shown!r}: {name} must be a power of two, not {n}")
    return out


@attrs.frozen
class Launch:
    """How the one-pass attention kernel runs: query heads per program
    (sharing one page-table walk), keys per loop iteration, warps per
    program, and the software-pipelining stages of the key loop. Written
    ``4x32w4s1``."""
    heads: int = 1
    block_n: int = 16
    warps: int = 1
    stages: int = 1

    def __str__(self) -> str:
        return f"{self.heads}x{self.block_n}w{self.warps}s{self.stages}"

    @classmethod
    def parse(cls, text: str) -> "Launch":
        launch = parse_settings(cls, r"(\d+)x(\d+)w(\d+)s(\d+)", "kernel launch",
                                "HEADSxBLOCKwWARPSsSTAGES, e.g. 4x32w4s1",
                                text, ("heads", "block_n", "warps"))
        if launch.stages < 1:
            raise ValueError(f"kernel launch {text!r}: stages must be at least 1")
        return launch


def split_chunk(length: int, max_splits: int = 64) -> int:
    """Keys per program of the split kernel: 32, or more so that a bucket of
    ``length`` keys needs at most ``max_splits`` programs per (row, head)."""
    if max_splits < 1:
        raise ValueError(f"split_chunk: max_splits must be at least 1, not {max_splits}")
    per = -(-length // max_splits)
    return max(32, 1 << (per - 1).bit_length())


@attrs.frozen
class Dispatch:
    """Which attention kernel, and which launch of it, a decode bucket runs.
    A bucket's rows and page count are fixed when its graph is captured, so
    the choice is made then, inside the op, from the count of (row, head)
    programs: the split kernel below ``split_below``; the one-pass kernel
    with a pipelined key loop below ``pipelined_below``; without pipelining
    from there. The defaults are the H200's measurements
    (docs/performance.md, "The attention kernels: measured per bucket").
    ``prefetch``: in a step of dependent launches (``pdl_step``), the split
    kernel reads its first keys and values before it waits for the q/k/v
    projection (earlier steps wrote them): on the H200 a Phi-1.5-shaped step
    went from 1.03 to 0.95 ms at one row, 1.11 to 1.08 at eight
    (docs/performance.md, "Dependent launches"). ``max_splits``: the split
    kernel's programs per (row, head) at most (``split_chunk``); more keys
    per program past that. ``split_block``: the split kernel's keys per
    loop iteration (its first block is the one read before the wait), at
    most a program's chunk; ``split_warps``: its warps per program.

    ``whole_rows``: in buckets of at most this many rows and ``whole_keys``
    keys that the split kernel runs, it runs as one program per (row,
    head) over all the bucket's keys (``paged_decode.whole_attention``):
    every key read before the wait, and the program finishes its own
    attention, so no pass combines partial states and none goes through
    memory. 0: none. Where the output projection combines the states
    (``KernelConfig.o_combines``) the split kernel runs as that asks."""
    split_below: int = 512
    pipelined_below: int = 2048
    pipelined: Launch = Launch(stages=3)
    plain: Launch = Launch()
    prefetch: bool = True
    max_splits: int = attrs.field(default=64)
    split_block: int = attrs.field(default=32)
    split_warps: int = attrs.field(default=2)
    whole_rows: int = attrs.field(default=0)
    whole_keys: int = attrs.field(default=256)

    @whole_rows.validator
    def _rows(self, _, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"Dispatch.whole_rows is a row count (0: none), not {value!r}")

    @max_splits.validator
    def _positive(self, _, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"Dispatch.max_splits must be a positive int, not {value!r}")

    @split_block.validator
    @split_warps.validator
    @whole_keys.validator
    def _power_of_two(self, field, value: int) -> None:
        low, top = {"split_block": (16, 256), "split_warps": (1, 8),
                    "whole_keys": (16, 512)}[field.name]
        if (not isinstance(value, int) or isinstance(value, bool) or value < low
                or value & (value - 1) or value > top):
            raise ValueError(f"Dispatch.{field.name} must be a power of two from {low} to {top}, "
                             f"not {value!r}")

    def chunk(self, length: int) -> int:
        """The split kernel's keys per program for a bucket of ``length``."""
        return split_chunk(length, self.max_splits)

    def choose(self, rows: int, heads: int, length: int) -> Launch | None:
        """The one-pass launch for a bucket, or None for the split kernel."""
        programs = rows * heads
        if programs < self.split_below and length > self.chunk(length):
            return None
        return self.pipelined if programs < self.pipelined_below else self.plain

    def whole(self, rows: int, length: int) -> bool:
        """Whether a bucket the split kernel runs runs it whole
        (``whole_rows``, ``whole_keys``)."""
        return rows <= self.whole_rows and length <= self.whole_keys

    def scalars(self) -> list[int]:
        """The dispatch as the custom ops take it (``from_scalars``)."""
        return [self.split_below, self.pipelined_below, *attrs.astuple(self.pipelined),
                *attrs.astuple(self.plain), int(self.prefetch), self.max_splits,
                self.split_block, self.split_warps, self.whole_rows, self.whole_keys]

    @classmethod
    def from_scalars(cls, values: list[int]) -> "Dispatch":
        if len(values) != 16:
            raise ValueError(f"a dispatch is 16 integers, not {len(values)}")
        return cls(values[0], values[1], Launch(*values[2:6]), Launch(*values[6:10]),
                   bool(values[10]), *values[11:])

    def forced(self, split_below: int | None = None, launch: Launch | None = None) -> "Dispatch":
        """This dispatch with a split threshold and/or one launch for every
        one-pass bucket imposed (benchmarks and profiles compare them)."""
        out = self if split_below is None else attrs.evolve(self, split_below=split_below)
        return out if launch is None else attrs.evolve(out, pipelined=launch, plain=launch)

    def __str__(self) -> str:
        split = f"split below {self.split_below} programs, " if self.split_below > 0 else ""
        early = "" if self.prefetch else "; under dependent launches, keys read after the wait"
        fields = Dispatch.__attrs_attrs__
        if self.max_splits != fields.max_splits.default:
            early += f"; at most {self.max_splits} split programs per (row, head)"
        if (self.split_block, self.split_warps) != (fields.split_block.default,
                                                    fields.split_warps.default):
            early += (f"; the split kernel {self.split_block} keys an iteration, "
                      f"{self.split_warps} warp{'s' if self.split_warps > 1 else ''}")
        if self.whole_rows:
            rows = "one row" if self.whole_rows == 1 else f"{self.whole_rows} rows"
            early += f"; a (row, head) in one program up to {rows} and {self.whole_keys} keys"
        if self.pipelined == self.plain:
            return f"{split}one-pass {self.plain}{early}"
        return (f"{split}one-pass {self.pipelined} below {self.pipelined_below} "
                f"programs, {self.plain} from there{early}")


@attrs.frozen
class Tile:
    """A launch of the decode-sized GEMM (``skinny_gemm``): output columns
    per program, K per iteration, K slices, warps, pipeline stages, and the
    steps of K read before the wait when launched dependent (``ahead``).
    Written ``64n128k4s4w3p``: 64 columns, 128 of K, 4 slices, 4 warps, 3
    stages (one step ahead); ``64n128k4s4w3p2a``: two steps ahead. A
    trailing ``v`` (``vector``, 1): the form without the MMA for up to
    eight rows, each program's whole slice of K read before the wait
    (``skinny_gemv``; stages and ahead unused). A trailing ``e``
    (``early``, 1; after the ``v`` where there is one): the GEMM lets the
    next kernel launch before it reads its weights and waits, as the norms
    do where ``KernelConfig.early_norms`` says."""
    block_n: int = 64
    block_k: int = 128
    split: int = 1
    warps: int = 4
    stages: int = 3
    ahead: int = 1
    vector: int = 0
    early: int = 0

    def __str__(self) -> str:
        ahead = f"{self.ahead}a" if self.ahead != 1 else ""
        vector = "v" if self.vector else ""
        early = "e" if self.early else ""
        return (f"{self.block_n}n{self.block_k}k{self.split}s{self.warps}w{self.stages}p"
                f"{ahead}{vector}{early}")

    @classmethod
    def parse(cls, text: str) -> "Tile":
        stripped = text.strip()
        early = stripped.endswith("e")
        vector = stripped[:len(stripped) - early].endswith("v")
        tile = parse_settings(cls, r"(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(?:(\d+)a)?", "GEMM tile",
                              "e.g. 64n128k4s4w3p, 64n128k4s4w3p2a, 16n128k1s4w1pv or "
                              "16n128k1s4w1pve", stripped[:len(stripped) - vector - early],
                              ("block_n", "block_k", "warps", "ahead"), shown=text)
        if tile.block_k < 16 or tile.split < 1 or tile.stages < 1:
            raise ValueError(f"GEMM tile {text!r}: needs block_k >= 16 (the MMA's K), "
                             "split >= 1 and stages >= 1")
        return attrs.evolve(tile, vector=int(vector), early=int(early))

    def fits(self, k: int) -> bool:
        """Whether K is whole steps of BLOCK_K (the kernel does not mask K)
        and each of the ``split`` slices gets at least ``ahead`` of them
        (slices differ by at most one step where they do not divide)."""
        return k % self.block_k == 0 and (k // self.block_k) // self.split >= self.ahead


TILE_FIELDS = len(attrs.fields(Tile))

# Per weight shape: ((up to rows, tile or None for cuBLAS), ...) by ascending
# rows; more rows than the last entry run cuBLAS.
Entries = tuple[tuple[int, "Tile | None"], ...]


def _freeze_tiles(table: Mapping[tuple[int, int], Entries] | tuple) -> tuple:
    items = table.items() if isinstance(table, Mapping) else table
    return tuple(sorted(((int(k), int(n)), tuple(entries)) for (k, n), entries in items))


@attrs.frozen
class TileTable:
    """Where a decode step runs our GEMM instead of cuBLAS: ``(K, N)`` ->
    entries. Empty: cuBLAS everywhere."""
    entries: tuple[tuple[tuple[int, int], Entries], ...] = attrs.field(
        default=(), converter=_freeze_tiles)

    def shapes(self) -> list[tuple[int, int]]:
        return [shape for shape, _ in self.entries]

    def tile_for(self, m: int, k: int, n: int) -> Tile | None:
        return tile_for(self.scalars(k, n), m)

    def scalars(self, k: int, n: int) -> list[int]:
        """Shape (k, n)'s entries as the GEMM op takes them (``tile_for``):
        rows and the tile's fields per entry, zeros for cuBLAS; empty when
        the shape has no entry."""
        for shape, entries in self.entries:
            if shape == (k, n):
                return [x for rows, tile in entries
                        for x in (rows, *(attrs.astuple(tile) if tile else (0,) * TILE_FIELDS))]
        return []

    @classmethod
    def read(cls, table: dict[str, list]) -> "TileTable":
        """From ``bench.gemm_tune --save``'s JSON: ``{"K,N": [[rows, tile or
        null], ...]}``."""
        out = {}
        for shape, entries in table.items():
            k, n = map(int, shape.split(","))
            out[k, n] = tuple(sorted(((int(m), Tile.parse(t) if t else None)
                                      for m, t in entries), key=lambda e: e[0]))
        return cls(out)

    def __str__(self) -> str:
        shapes = [f"{k}->{n}" for k, n in self.shapes()]
        return f"ours for {', '.join(shapes)} at measured rows" if shapes else "cuBLAS"


def step_tile(k: int, n: int, rows: int, partial: bool, sms: int) -> Tile | None:
    """A tile for a GEMM of the dependent-launch step where the table has
    none: enough programs to cover the GPU's ``sms`` twice where the shape
    allows. A GEMM whose output goes to a norm (``partial``) splits K and
    leaves the sum to it; one whose output feeds a kernel as is keeps K
    whole and narrows its columns instead. None when K cannot be cut into
    steps of at least 16."""
    want = 2 * sms
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
    if block_k is None:
        return None
    stages = 3 if rows <= 16 else 4
    if not partial:
        block_n = next((b for b in (64, 32) if -(-n // b) >= sms), 16)
        return Tile(block_n, block_k, 1, 4, stages)
    block_n = 32 if n <= 4096 else 64
    cols = -(-n // block_n)
    # Steps of K of at least 64 where K allows (a narrower load costs more
    # than fewer programs); then the fewest slices that reach ``want``
    # programs, else the most programs.
    steps = [b for b in (128, 64) if k % b == 0] or [b for b in (32, 16) if k % b == 0][:1]
    options = [(min(cols * s, want), -s, b) for b in steps
               for s in range(1, min(k // b, 16) + 1) if (k // b) % s == 0]
    _, split, block_k = max(options)
    return Tile(block_n, block_k, -split, 4, stages)


def tile_for(scalars: list[int], m: int) -> Tile | None:
    """The tile for ``m`` rows in ``TileTable.scalars``' form, or None (cuBLAS)."""
    for i in range(0, len(scalars), TILE_FIELDS + 1):
        if m <= scalars[i]:
            return Tile(*scalars[i + 1:i + TILE_FIELDS + 1]) if scalars[i + 1] else None
    return None


# Rows up to which a decode step samples ahead by default: where a step is
# short enough that finalize's sampling is a share of it worth saving.
SAMPLE_AHEAD = 8


@attrs.frozen
class KernelConfig:
    """Everything that decides which kernels a decode step runs (the
    decoder itself, compilation and graphs are the backend's options).

    ``new_token``: rotary embeddings and the KV write inside the attention
    kernel, instead of two compiled kernels before it. ``mlp_act``: Phi's
    MLP activation inside it too, instead of a kernel of its own. Both
    measured faster on the H200 (docs/performance.md). ``prefill_store``: a
    prefill's rotary, KV write and Phi's activation as one kernel before it
    attends (``rope_store``), instead of torch's dozen a layer: on the H200
    it cut a point request's device time by a fifth
    (docs/runs/prefill-store-ab-2026-12-01.txt).

    ``pdl_rows``: decode buckets of at most this many rows run the step
    whose kernels are all ours, each launched dependent on the one before
    (``pdl_step``; Hopper and later, with ``new_token``); 0: none. Their
    GEMMs take ``pdl_tiles``' tile for a shape and row count where it has
    one (``bench.pdl_tune``), else ``step_tile``'s; a Llama or Qwen2 q, k, v
    tile that cuts K leaves the sums to the attention kernels
    (``pdl_step.project_attend``). ``last_combines``: in
    that step's buckets of at most this many rows, the split attention
    kernel's last program of each (row, head) combines the partial states,
    instead of a second kernel (one launch fewer a layer); bit for bit the
    two kernels' result. 0: none. Where it pays depends on the rows: on the
    H200 Llama-3.2-1B's step went 0.857 -> 0.846 ms at one row and 0.888 ->
    0.865 at two, was even at four and lost 0.021 at eight; Phi-1.5's
    0.913 -> 0.908 and 0.959 -> 0.938, even at four and eight; Qwen2-0.5B's
    within 0.002 either way (docs/performance.md, "The last programs
    combining, per bucket"), so ``measured.MEASURED_PDL`` sets it per shape.
    ``o_combines``: in that step's buckets of at most this many rows where
    the split attention kernel runs, no pass combines its partial states:
    Llama's and Qwen2's output projection combines them as it reads them
    (``paged_decode.split_states``, ``skinny_gemm``'s STATES), one kernel
    boundary and one round of arrivals fewer a layer. It takes precedence
    over ``last_combines``; Phi's output GEMM also reads the MLP's half,
    so Phi keeps them. 0: none.

    ``early_norms``: in that step's buckets of at most this many rows, each
    norm lets the next kernel launch before it waits for its own
    predecessor (``pdl.release``): the GEMM after a norm (q, k, v; gate and
    up; the head) is placed and reads its first weights while the output
    projection before the norm still runs, instead of only while the norm
    does. 0: none. ``early_attention``: the same for the split attention
    kernel in the buckets where the output projection combines its states
    (at most ``o_combines`` rows): the projection is placed, and reads its
    weights, while the q, k, v projection before the attention still runs.
    0: none.

    ``norms_in``: in that step's buckets of at most this many rows, a
    Llama or Qwen2 layer with 16-bit weights and a gated MLP runs no norm
    kernel: q, k, v and gate and up norm the residual stream themselves,
    and o and down keep K whole and add their output to it
    (``pdl_step.chained_layer``, ``normed_gemv``): four kernels a layer,
    five with the split attention kernel's combine, where the step runs
    six or seven. Their tiles are ``pdl_tiles``' where those are the vector
    form with K whole, else ``normed_gemv.choose``'s; the split kernel's
    states are combined by it or its own kernel (``last_combines``), not by
    the projection (``o_combines`` does not apply). 0: none.

    ``sample_ahead``: decode buckets of at most this many rows sample
    greedily, unmasked, at the end of the forward's graph; a finalize whose
    rows are all greedy with no mask and no value keeps those tokens and
    launches no sampling, any other samples as before (``CudaBackend``).
    0: none.

    ``draw_kernel``: drawn steps draw their Gumbel noise in Triton
    (``gumbel``), in every bucket (a row's draw must not depend on the rows
    beside it): a step whose drawn rows have no cut samples in
    ``greedy_sample``'s one kernel instead of torch's some thirty, and one
    with a cut adds one kernel's noise to torch's sort. On the H200 at
    Qwen2's vocabulary a step's sampling went 140 -> 12 us at one row
    without a cut and 271 -> 176 with top_p, and the sampled workload
    1,269 -> 1,554 tok/s at one stream and 11,557 -> 15,168 at 32
    (docs/performance.md, "Drawn steps' noise in one kernel"). Off: torch's
    noise (the before of a before/after; where Triton is absent it runs
    anyway).

    ``cut_kernel``: a drawn step with a cut (top_k, top_p or min_p)
    samples in two kernels around torch's sort (``cut_sample``): one
    writes the rows' masked, scaled logits, one walks each sorted row
    from its most likely token to where the cuts end, where torch's path
    runs some twenty kernels over the whole vocabulary besides the sort.
    Its nucleus rounds as the kernel adds it (``cut_sample``'s doc), in
    every bucket. Needs ``draw_kernel`` (a row's noise must be the one
    its step without a cut would add). Off until measured on a GPU.

    ``greedy_kernel``: a greedy step samples in one kernel
    (``greedy_sample``) instead of torch's seven; ``step_inputs``: a fused
    decode step gathers its rows' inputs, KV slots and rotary values in one
    kernel (``step_inputs``) instead of about twenty of torch's. Off: the
    torch paths (the before of a before/after; where Triton is absent they
    run anyway)."""
    dispatch: Dispatch = Dispatch()
    new_token: bool = True
    mlp_act: bool = True
    prefill_store: bool = True
    tiles: TileTable = TileTable()
    pdl_rows: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    pdl_tiles: TileTable = TileTable()
    last_combines: int = attrs.field(default=0)
    greedy_kernel: bool = True
    step_inputs: bool = True
    o_combines: int = attrs.field(default=0)
    early_norms: int = attrs.field(default=0)
    early_attention: int = attrs.field(default=0)
    sample_ahead: int = attrs.field(default=SAMPLE_AHEAD)
    norms_in: int = attrs.field(default=0)
    draw_kernel: bool = True
    cut_kernel: bool = attrs.field(default=False)

    @cut_kernel.validator
    def _cut_needs_draw(self, field, value: bool) -> None:
        if value and not self.draw_kernel:
            raise ValueError("KernelConfig.cut_kernel needs draw_kernel: a drawn row's noise "
                             "must be the kernel's whether its step cuts or not")

    @norms_in.validator
    @last_combines.validator
    @o_combines.validator
    @early_norms.validator
    @early_attention.validator
    @sample_ahead.validator
    def _rows(self, field, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"KernelConfig.{field.name} is a row count (0: none), not {value!r}")

    @classmethod
    def measured(cls, device: torch.device | str, config: Any = None, *,
                 dtype: torch.dtype = torch.bfloat16) -> "KernelConfig":
        """The defaults measured for ``device``'s GPU (``for_gpu``), for a
        model of transformers ``config`` whose weights are ``dtype``."""
        device = torch.device(device)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        return cls.for_gpu(name, config, dtype=dtype)

    @classmethod
    def for_gpu(cls, name: str, config: Any = None, *,
                dtype: torch.dtype = torch.bfloat16) -> "KernelConfig":
        """The defaults, with the GEMM tiles measured for the GPU ``name``
        (none elsewhere, so cuBLAS, until it is measured) and, for a model
        of ``config``'s shape, the dependent-launch step where it was
        measured faster on that GPU (``measured.MEASURED_PDL``). Both only
        for weights of two bytes (``measured.MEASURED_DTYPES``): the tiles
        were measured in bfloat16, and in float32 some of them need more
        shared memory than a multiprocessor has (tests/test_gemm_compiles.py)."""
        # Here, not at the top: the tables are written in this module's types.
        from bubblefree.cuda_backend.measured import MEASURED, MEASURED_DTYPES, MEASURED_PDL, model_shape
        if dtype not in MEASURED_DTYPES:
            return cls()
        pdl_rows, pdl_tiles, combines, o_combines, early, early_attention, norms_in, dispatch = \
            MEASURED_PDL.get(name, {}).get(model_shape(config),
                                           (0, TileTable(), 0, 0, 0, 0, 0, Dispatch()))
        return cls(tiles=MEASURED.get(name, TileTable()), pdl_rows=pdl_rows, pdl_tiles=pdl_tiles,
                   last_combines=combines, o_combines=o_combines, early_norms=early,
                   early_attention=early_attention, norms_in=norms_in, dispatch=dispatch)

    def __str__(self) -> str:
        where = ""
        if not self.new_token:
            where = "; rotary and KV write separate"
        elif not self.mlp_act:
            where = "; Phi's MLP activation separate"
        if not self.prefill_store:
            where += "; prefill's rotary and KV write in torch"
        if self.pdl_rows:
            where += f"; dependent launches up to {self.pdl_rows} rows"
            chained = min(self.norms_in, self.pdl_rows)  # o_combines, early_attention: past these
            if (rows := min(self.o_combines, self.pdl_rows)) > chained:
                where += (", the output projection combining split attention "
                          + ("at one row" if rows == 1 else f"up to {rows} rows"))
            if (rows := min(self.last_combines, self.pdl_rows)) > self.o_combines:
                where += f", the split kernel's last programs combining up to {rows} rows"
            if rows := min(self.early_norms, self.pdl_rows):
                where += f", the norms releasing the next kernel early up to {rows} rows"
            if (rows := min(self.early_attention, self.o_combines, self.pdl_rows)) > chained:
                where += (", the split attention kernel releasing the projection early "
                          + ("at one row" if rows == 1 else f"up to {rows} rows"))
            if chained:
                where += (", Llama's and Qwen2's layers without norm kernels "
                          + ("at one row" if chained == 1 else f"up to {chained} rows"))
        if self.sample_ahead != SAMPLE_AHEAD:
            where += (f"; tokens sampled ahead in the forward up to {self.sample_ahead} rows"
                      if self.sample_ahead else "; no tokens sampled ahead in the forward")
        if not self.greedy_kernel:
            where += "; greedy sampling in torch"
        if not self.draw_kernel:
            where += "; drawn steps' noise in torch"
        if self.cut_kernel:
            where += "; drawn steps with a cut sampled around the sort in two kernels"
        if not self.step_inputs:
            where += "; step inputs in torch"
        return f"attention: {self.dispatch}{where}; GEMM: {self.tiles}"
