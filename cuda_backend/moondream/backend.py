"""MoondreamBackend: moondream2 behind the Backend contract, in the two slots.

The text decoder is the CudaBackend's fused Phi path (``text.to_phi``
shares its weights); on top of it (``Capacity.images`` and ``.values``):

    launch    IMAGE_PREFILL (``image_prefill``): the crops of the step's
              images not encoded yet (all rows' at once) copied from pinned
              host memory and through the vision encoder in one call; then
              one packed prefill over [BOS, 729 image features, prompt] per
              row, the prefix attending both ways (both in CUDA graphs:
              ``encoder_graphs``, ``prefill_graphs``). An ``EncodedImage`` is
              encoded by the first step that uses it and keeps its prefix
              KV on the device: later rows copy it into their pages and
              prefill their prompt alone. Every forward keeps its rows'
              last hidden states in the slot.
    finalize  after the tokens, only when the SamplePlan asks values: the
              region head on the slot's hidden states (a graph per bucket),
              each value row's value into the slot and its encoding into
              the row's next decode input; the values' host copy rides the
              copy stream with the tokens, after the same event.
    wait      the tokens, and the values where asked.

Everything is enqueued on the compute stream without a host sync; crops and
metadata come from pinned memory. A steady-state decode step with no value
row runs exactly the CudaBackend's work plus the graph's few extra ops (I10).
``image_ref`` and ``encode_image`` are the host side, for callers' threads.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
from PIL import Image

from bubblefree.core.values import ImageRef, InvalidRequest, SamplePlan, StepKind, StepOutput, StepPlan
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import PlanRejected
from bubblefree.cuda_backend.graphs import GraphSet, bucket
from bubblefree.cuda_backend.moondream import image_prefill, prompt_values
from bubblefree.cuda_backend.moondream.encoder_graphs import EncoderGraphs
from bubblefree.cuda_backend.moondream.image_prefill import ImageWork, refusal
from bubblefree.cuda_backend.moondream.model import Moondream
from bubblefree.cuda_backend.moondream.prefill_graphs import PrefillGraphs
from bubblefree.cuda_backend.moondream.prepared import EncodedImage, PreparedImage, prepare
from bubblefree.cuda_backend.moondream.region_head import COORD, KIND_CODES, NONE, RegionHead
from bubblefree.cuda_backend.moondream.runner import MoondreamRunner
from bubblefree.cuda_backend.moondream.text import to_phi
from bubblefree.cuda_backend.slots import DecodeSlot


@attrs.define(eq=False)
class ValueSlot:
    """A DecodeSlot's moondream part: the step's hidden states, the value
    kinds it asked, its values on the device and their pinned landing."""

    hidden: torch.Tensor  # [max_rows, D] device, model dtype
    kinds_staging: torch.Tensor  # [max_rows] int64 host (pinned)
    kinds_np: np.ndarray
    kinds: torch.Tensor  # [max_rows] int64 device: region_head codes
    values: torch.Tensor  # [max_rows, 2] float32 device
    landing: torch.Tensor  # [max_rows, 2] float32 host (pinned)
    prompt_staging: torch.Tensor  # [4 * max_prefill_tokens] int64 host (pinned): prompt_values.stage
    asked: tuple = ()  # the SamplePlan's values: () or a kind (or None) per row
    work: ImageWork = attrs.Factory(ImageWork)  # an image prefill's, settled at release

    @classmethod
    def make(cls, rows: int, dim: int, dtype: torch.dtype, device: torch.device,
             prefill_tokens: int) -> "ValueSlot":
        pin = device.type == "cuda"
        staging = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        return cls(hidden=torch.zeros(rows, dim, dtype=dtype, device=device),
                   kinds_staging=staging, kinds_np=staging.numpy(),
                   kinds=torch.zeros(rows, dtype=torch.long, device=device),
                   values=torch.zeros(rows, 2, dtype=torch.float32, device=device),
                   landing=torch.zeros(rows, 2, dtype=torch.float32, pin_memory=pin),
                   prompt_staging=torch.zeros(4 * prefill_tokens, dtype=torch.long, pin_memory=pin))


# An image row is 730 positions and its prompt: room for five in one prefill
# (CudaBackend's 2048 would take two).
DEFAULT_MAX_PREFILL_TOKENS = 4096


class MoondreamBackend(CudaBackend):
    runner_class = MoondreamRunner
    takes_images = True
    decodes_values = True

    def __init__(self, model: Moondream, crops_on_device: bool = True, **options):
        """``model``: a ``Moondream`` (weights.load_checkpoint / random_model);
        ``crops_on_device``: on CUDA, callers' images are resized and cut on
        the device (``prepared.prepare``; the same pixels as Pillow's path,
        checked on the CPU and on the H200, where a 756-px image's crops
        took 3.8 ms against Pillow's 19.6; False: Pillow on the caller's
        thread); ``options``:
        CudaBackend's (``max_prefill_tokens`` defaults to
        ``DEFAULT_MAX_PREFILL_TOKENS``). Its prefills always run the packed
        path here (``token_prefill`` is refused)."""
        if options.get("token_prefill"):
            raise InvalidRequest("token_prefill: moondream's prefills run their own packed path")
        if not options.get("fused_decode", True):
            raise InvalidRequest("fused_decode: moondream's decode step is the fused Phi one")
        self.config = model.config
        self.vision, self.region = model.vision.eval(), model.region.eval()
        self.prefix_len = model.config.text.prefix_attn  # BOS + one crop's patches
        options = {"max_prefill_tokens": DEFAULT_MAX_PREFILL_TOKENS, **options, "token_prefill": 0}
        super().__init__(to_phi(model.text, share=True), **options)
        for part in (self.vision, self.region):
            param = next(part.parameters())
            if (param.device, param.dtype) != (self.device, self.dtype):
                raise InvalidRequest(f"model: vision and region must be on {self.device} in "
                                     f"{self.dtype} like the text, got {param.device} {param.dtype}")
        self._pin = self.device.type == "cuda"
        # Callers' threads resize and cut their images here, beside the steps.
        self._crop_stream = torch.cuda.Stream(self.device) if self._pin and crops_on_device else None
        rows = self._cap.max_rows
        self._head = RegionHead(self.region, rows, self.device)
        self._vslots = [ValueSlot.make(rows, self.config.text.dim, self.dtype, self.device,
                                       self._cap.max_prefill_tokens) for _ in (0, 1)]
        self._value_graphs = GraphSet(self.device, options.get("use_graphs", True))
        if self._value_graphs.enabled:
            self._capture_values()
        self._encoder, self._prefill = self._image_graphs() if self.prefill_graphs else (None, None)
        self._sync()

    def _image_graphs(self) -> tuple[EncoderGraphs, PrefillGraphs | None]:
        """The encoder's and the packed prefill's graphs, captured now (warm-up,
        after the decode graphs, into their pool: every replay runs on the one
        compute stream and its outputs are consumed in stream order). Without
        CUDA the same bucketed code runs eagerly."""
        share = self._decode_graphs
        prefill = PrefillGraphs.make(self._runner, self.prefix_len, self._pages,
                                     GraphSet(self.device, True, share_pool_of=share), self.region)
        rows = prefill.rm if prefill is not None else 1
        encoder = EncoderGraphs(self.vision, rows * (self.config.vision.max_crops + 1),
                                GraphSet(self.device, True, share_pool_of=share), self.device)
        with self._on(self._compute):
            if prefill is not None:
                prefill.capture()  # the larger graphs first: the encoder's reuse their memory
            encoder.capture()
        self._sync()
        return encoder, prefill

    @property
    def prefill_path(self) -> str:
        if self._prefill is None:
            return "image prefix and prompt packed, eager (attention over gathered pages)"
        where = "in graphs" if self._prefill.graphs.enabled else "bucketed, eager"
        return (f"image prefix and prompt packed, {where} up to {self._prefill.rm} rows and "
                f"{self._prefill.pages * self.capacity.page_size} positions, else eager")

    # -- host side: callers' threads ---------------------------------------------------

    def image_ref(self, image: Image.Image | EncodedImage) -> ImageRef:
        """An RGB PIL image (``bubblefree.images.load_image``'s) or an
        ``EncodedImage`` of this backend -> the ``ImageRef`` a request
        carries. Thread safe; crops the image here, encodes nothing."""
        if isinstance(image, EncodedImage):
            if not image.made_by(self):
                raise InvalidRequest("image: an EncodedImage made by another backend")
            return ImageRef(length=image.length, source=image)
        return ImageRef(length=self.prefix_len, source=self._prepare(image))

    def encode_image(self, image: Image.Image | EncodedImage) -> EncodedImage:
        """An image to ask several questions of: crops now (thread safe); the
        first image prefill that uses it encodes it on the device, once."""
        if isinstance(image, EncodedImage):
            return self.image_ref(image).source
        return EncodedImage(owner=self, prepared=self._prepare(image), length=self.prefix_len)

    def _prepare(self, image) -> PreparedImage:
        if not isinstance(image, Image.Image):
            raise InvalidRequest(f"image: must be a PIL image or an EncodedImage, got "
                                 f"{type(image).__name__}")
        if image.mode != "RGB":
            raise InvalidRequest(f"image: must be RGB (bubblefree.images.load_image), got mode "
                                 f"{image.mode!r}")
        return prepare(image, self.config.vision, self._pin, self._crop_stream)

    # -- launch ----------------------------------------------------------------------

    def _check_launch(self, plan: StepPlan) -> None:
        if plan.kind is not StepKind.IMAGE_PREFILL:
            return
        for r in plan.rows:
            why = refusal(r.image.source, r.image.length, self.prefix_len, self)
            if why:
                raise PlanRejected(f"step {plan.step_id}: row of seq {r.seq_id}: {why}")

    def _forward(self, s: DecodeSlot, plan: StepPlan) -> tuple[torch.Tensor, int]:
        v = self._vslots[s.index]
        if plan.kind is StepKind.DECODE:
            logits, b = super()._forward(s, plan)
            self._defer(s, v.hidden[:b], self._runner.hidden[:b])  # read only by a value decode
            return logits, b
        n = len(plan.rows)
        if plan.kind is StepKind.IMAGE_PREFILL:
            logits, hidden = image_prefill.launch(self, plan, s, v.work)  # [n, V], [n, D]
        else:
            logits, hidden = self._text_prefill(s, plan)
        v.hidden[:n].copy_(hidden[:n])
        return logits, bucket(n, self._rows)

    def _text_prefill(self, s: DecodeSlot, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill without images: the image prefill's graphs where its
        rows fit one (no prefix, no features), else eager."""
        inputs = [np.asarray(r.tokens, dtype=np.int64) for r in plan.rows]
        starts = np.array([r.position for r in plan.rows], dtype=np.int64)
        values = prompt_values.locate(plan.rows, inputs, [0] * len(inputs))
        key = self._prefill.key(inputs, starts, len(values)) if self._prefill is not None else None
        if key is not None:
            return self._prefill.launch(s.index, key, [r.pages for r in plan.rows], inputs,
                                        starts, np.zeros(len(inputs), dtype=np.int64), [],
                                        None, [], values)
        k, shape = self._runner.pack_prefill(plan, s.staging_np)
        meta = s.staging[:k].to(self.device, non_blocking=True)
        return self._runner.prefill(meta, shape, values=self.values_input(s, values))

    def values_input(self, s: DecodeSlot, values: list):
        """An eager prefill's prompt values (``prompt_values.locate``'s) as
        ``runner.prefill``'s ``values``: staged in the slot's pinned buffer
        (reused only after the slot's release, I4) and copied in stream
        order; None without any."""
        if not values:
            return None
        n = len(values)
        staging = self._vslots[s.index].prompt_staging
        prompt_values.stage(staging.numpy(), values, n)
        meta = staging[:4 * n].to(self.device, non_blocking=True)
        return lambda x: prompt_values.overwrite(x, self.region, meta, n)

    def _forward_failed(self, s: DecodeSlot) -> None:
        self._vslots[s.index].work.settle(failed=True)

    def _released(self, s: DecodeSlot, failed: bool) -> None:
        self._vslots[s.index].work.settle(failed)

    # -- finalize and wait -------------------------------------------------------

    def _sample_clears(self) -> torch.Tensor:
        # A row that asks no value feeds its token back; a value row's flag is
        # set again by the value decode, enqueued after the sampling.
        return self._runner.value_flag

    def _after_sampling(self, s: DecodeSlot, sample: SamplePlan, b: int, greedy: bool) -> None:
        v = self._vslots[s.index]
        v.asked = sample.values
        if not sample.values:  # the common step: no region work at all
            return
        v.kinds_np[:b] = NONE
        v.kinds_np[:len(sample.values)] = [KIND_CODES[k] for k in sample.values]
        v.kinds[:b].copy_(v.kinds_staging[:b], non_blocking=True)
        self._value_graphs.run((s.index, b, greedy), lambda: self._decode_values(s, b, greedy))

    def _decode_values(self, s: DecodeSlot, b: int, greedy: bool) -> torch.Tensor:
        """What the value graphs record for slot ``s`` at bucket ``b``."""
        v, r = self._vslots[s.index], self._runner
        kinds = v.kinds[:b]
        values, embeds = self._head.decode(v.hidden[:b], kinds, s.sample_inputs, b, greedy)
        v.values[:b].copy_(values)
        row_slots = s.sample_inputs[:b]  # padded rows: the scratch row
        r.value_emb.index_copy_(0, row_slots, embeds)
        r.value_flag.index_copy_(0, row_slots, kinds != NONE)
        return v.values

    def _copy_out(self, s: DecodeSlot, n: int) -> None:
        super()._copy_out(s, n)
        v = self._vslots[s.index]
        if v.asked:
            v.landing[:n].copy_(v.values[:n], non_blocking=self._copy is not None)

    def _output(self, s: DecodeSlot) -> StepOutput:
        out = super()._output(s)
        v = self._vslots[s.index]
        if not v.asked:
            return out
        landed = v.landing[:len(out.tokens)].tolist()
        values = tuple(None if k is None else x if KIND_CODES[k] == COORD else (x, y)
                       for k, (x, y) in zip(v.asked, landed))
        return attrs.evolve(out, values=values)

    def _capture_values(self) -> None:
        self._capture_per_slot(self._value_graphs, self._decode_values,
                               reset=lambda s: self._vslots[s.index].kinds.zero_())
