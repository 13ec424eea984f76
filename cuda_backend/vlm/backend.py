"""VlmBackend: a transformers vision-language model behind the Backend contract.

The text decoder is served as any transformers decoder (``CudaBackend``:
decode steps in graphs, fused where the architecture has it, text-only
prefills as before). On top of it, ``Capacity.images``:

    launch    IMAGE_PREFILL: the pixels of the rows not encoded yet copied
              from pinned host memory into one device buffer, through the
              model's vision tower and projector in one call (all those rows
              at once; an encoded image keeps its features on the device
              after its first step, ``encode_image``); one packed prefill
              over [head, one position per feature, prompt] per row, the
              features written over the embeddings at their positions,
              attention causal throughout (as the model's own forward).
              Eager: its shapes follow the prompts.
    finalize, wait    the CudaBackend's.

``image_ref`` and ``encode_image`` are the host side, for callers' threads:
the model's own image processor, whose pixels land in pinned memory. A slot
keeps its step's pixels until release (I4): the copy may still be reading
them; a step that fails makes the images it encoded forget their features.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from bubblefree.core.values import ImageRef, InvalidRequest, StepKind, StepPlan
from bubblefree.cuda_backend.attention import CONTEXT_KWARG
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import PlanRejected
from bubblefree.cuda_backend.graphs import bucket
from bubblefree.cuda_backend.slots import DecodeSlot
from bubblefree.cuda_backend.vlm.model import VisionLanguage
from bubblefree.cuda_backend.vlm.pixels import VlmPixels, pixel_values, prepare


class VlmBackend(CudaBackend):
    takes_images = True

    def __init__(self, model: VisionLanguage, processor: Any, head: Sequence[int], **options: Any):
        """``model``: ``VisionLanguage.of(vlm)``; ``processor``: the model's
        image processor (``pixel_values`` out of a PIL image); ``head``: the
        ids the chat template puts before the image (``ImageTurn.head``);
        ``options``: CudaBackend's."""
        self.vl, self.processor = model, processor
        self.head = np.asarray([int(t) for t in head], dtype=np.int64)
        super().__init__(model.text, **options)
        for part in model.vision_parts:
            param = next(part.parameters())
            if (param.device, param.dtype) != (self.device, self.dtype):
                raise InvalidRequest(f"model: the vision tower and projector must be on {self.device} "
                                     f"in {self.dtype} like the text, got {param.device} {param.dtype}")
        # One blank image through the processor and the tower: the pixels'
        # shape and the features per image are the model's, whatever the image.
        probe = pixel_values(processor, Image.new("RGB", (64, 48)))
        self.pixel_shape = tuple(probe.shape)
        with torch.no_grad():
            features = model.image_features(probe[None].to(self.device, self.dtype))
        dim = model.text.get_input_embeddings().weight.shape[1]
        if features.ndim != 3 or features.shape[2] != dim:
            raise InvalidRequest(f"model: its image features are {tuple(features.shape)}, the text "
                                 f"takes width {dim}")
        self.features_per_image = int(features.shape[1])
        self.prefix_len = len(self.head) + self.features_per_image
        rows = self._cap.max_rows
        self._pixels = torch.zeros(rows, *self.pixel_shape, dtype=torch.float32, device=self.device)
        self._feature_offsets = torch.arange(len(self.head), self.prefix_len, device=self.device)
        self._kept: list[list[VlmPixels]] = [[], []]  # per slot: pixels a copy may read (I4)
        self._sync()

    @property
    def prefill_path(self) -> str:
        return f"images: vision tower and packed prefill, eager; text: {super().prefill_path}"

    # -- host side: callers' threads ---------------------------------------------------

    def image_ref(self, image: Image.Image | VlmPixels) -> ImageRef:
        """An RGB PIL image (``bubblefree.images.load_image``'s) or an
        ``encode_image`` of this backend -> the ``ImageRef`` a request
        carries. Thread safe: the processor runs here, on the caller's
        thread."""
        if isinstance(image, VlmPixels):
            if not image.made_by(self):
                raise InvalidRequest("image: encoded by another backend")
            return ImageRef(length=self.prefix_len, source=image)
        return ImageRef(length=self.prefix_len, source=self._prepare(image, keep=False))

    def encode_image(self, image: Image.Image) -> VlmPixels:
        """An image to ask several questions of: processed now (thread
        safe); the first image prefill that uses it encodes it, and its
        features stay on the device for the next ones."""
        return self._prepare(image, keep=True)

    def _prepare(self, image: Any, keep: bool) -> VlmPixels:
        if not isinstance(image, Image.Image):
            raise InvalidRequest(f"image: must be a PIL image, got {type(image).__name__}")
        if image.mode != "RGB":
            raise InvalidRequest(f"image: must be RGB (bubblefree.images.load_image), got mode "
                                 f"{image.mode!r}")
        return prepare(self.processor, image, self.pixel_shape, self.device.type == "cuda", self, keep)

    # -- launch ----------------------------------------------------------------------

    def _check_launch(self, plan: StepPlan) -> None:
        if plan.kind is not StepKind.IMAGE_PREFILL:
            return
        for r in plan.rows:
            why = None
            if r.image.length != self.prefix_len:
                why = f"image length {r.image.length}, this model's prefix is {self.prefix_len}"
            elif not isinstance(r.image.source, VlmPixels) or not r.image.source.made_by(self):
                why = f"an image source this backend did not make ({type(r.image.source).__name__})"
            if why:
                raise PlanRejected(f"step {plan.step_id}: row of seq {r.seq_id}: {why}")

    def _forward(self, s: DecodeSlot, plan: StepPlan) -> tuple[torch.Tensor, int]:
        if plan.kind is not StepKind.IMAGE_PREFILL:
            return super()._forward(s, plan)
        rows, runner, n = plan.rows, self._runner, len(plan.rows)
        fill = np.full(self.features_per_image, self.vl.image_token_id, dtype=np.int64)
        inputs = [np.concatenate((self.head, fill, np.asarray(r.tokens, dtype=np.int64))) for r in rows]
        k, shape = runner.pack_prefill(plan, s.staging_np, inputs)
        meta = s.staging[:k].to(self.device, non_blocking=True)
        features = self._features(s, [r.image.source for r in rows])  # [n, F, D]
        input_ids, positions, last, ctx = runner.prefill_inputs(meta, shape)
        t = shape[0]
        q_start = meta[4 * t:4 * t + n]  # each row's first packed index (runner.pack_prefill)
        where = (q_start[:, None] + self._feature_offsets[None, :]).reshape(-1)  # [n * F]
        embeds = self.vl.text.get_input_embeddings()(input_ids)  # [1, T, D]
        embeds[0].index_copy_(0, where, features.reshape(-1, embeds.shape[-1]).to(embeds.dtype))
        out = self.vl.text(inputs_embeds=embeds, position_ids=positions, use_cache=False,
                           logits_to_keep=last, **{CONTEXT_KWARG: ctx})
        return out.logits[0], bucket(n, self._rows)  # [n, V]

    def _features(self, s: DecodeSlot, sources: list[VlmPixels]) -> torch.Tensor:
        """The rows' image features ``[n, F, D]``: the tower and projector
        once over the images without features yet (their pixels through one
        shared device buffer: every use is in stream order, I1); an encoded
        image keeps what it got."""
        fresh = [i for i, src in enumerate(sources) if src.features is None]
        self._kept[s.index] = [sources[i] for i in fresh]
        computed = None
        if fresh:
            for j, i in enumerate(fresh):
                self._pixels[j].copy_(sources[i].pixels, non_blocking=True)
            computed = self.vl.image_features(self._pixels[:len(fresh)].to(self.dtype))
            for j, i in enumerate(fresh):
                if sources[i].keep and sources[i].features is None:  # twice in a step: the first
                    sources[i].features = computed[j]
        if len(fresh) == len(sources):
            return computed
        at = {i: j for j, i in enumerate(fresh)}
        return torch.stack([computed[at[i]] if i in at else src.features for i, src in enumerate(sources)])

    def _settle(self, s: DecodeSlot, failed: bool) -> None:
        """A step's end: a failed one's encoded images forget the features
        it meant to compute (the next step encodes them again)."""
        if failed:
            for source in self._kept[s.index]:
                source.features = None
        self._kept[s.index] = []

    def _forward_failed(self, s: DecodeSlot) -> None:
        self._settle(s, True)

    def _released(self, s: DecodeSlot, failed: bool) -> None:
        self._settle(s, failed)
