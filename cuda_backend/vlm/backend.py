"""VlmBackend: a transformers vision-language model behind the Backend contract.

The text decoder is served as any transformers decoder (``CudaBackend``:
decode steps in graphs, fused where the architecture has it, text-only
prefills as before). On top of it, ``Capacity.images``:

    launch    IMAGE_PREFILL (``image_prefill``): the tensors of the images
              not encoded yet copied from pinned host memory, through the
              model's vision tower and projector, one call per shape; one
              packed prefill over [head, the image's block, prompt] per row
              (the block: the processor's expansion of the image token, a
              placeholder per feature), the features written over the
              placeholders' embeddings in order, attention causal
              throughout (as the model's own forward; a prefix LM's prompt,
              PaliGemma's, both ways, as its text-only prefills). An
              encoded image keeps its prefix KV (a prefix LM's: its
              features) on the device after its first step
              (``encode_image``). The tower replays graphs where its
              input has one shape (``tower_graphs``: LLaVA, PaliGemma);
              the rest is eager: its shapes follow the prompts.
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
from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.errors import PlanRejected
from bubblefree.cuda_backend.graphs import GraphSet, bucket
from bubblefree.cuda_backend.vlm import image_prefill
from bubblefree.cuda_backend.slots import DecodeSlot
from bubblefree.cuda_backend.vlm.model import VisionLanguage
from bubblefree.cuda_backend.vlm.mrope import MropeRunner
from bubblefree.cuda_backend.vlm.pixels import VlmPixels, prepare
from bubblefree.cuda_backend.vlm.tower_graphs import TowerGraphs


class VlmBackend(CudaBackend):
    takes_images = True

    def __init__(self, model: VisionLanguage, processor: Any, head: Sequence[int], token: str,
                 **options: Any):
        """``model``: ``VisionLanguage.of(vlm)``; ``processor``: the model's
        processor (an image and its placeholder's text in, the expanded ids
        and pixels out); ``head``: the ids the chat template puts before the
        image, ``token`` the placeholder's text (``ImageTurn``);
        ``options``: CudaBackend's."""
        self.vl, self.processor, self.token = model, processor, token
        self.head = np.asarray([int(t) for t in head], dtype=np.int64)
        if model.mrope:  # its decode steps add each row's rotary delta
            self.runner_class = MropeRunner
        self._tower: TowerGraphs | None = None
        super().__init__(model.text, **options)
        for part in model.vision_parts:
            param = next(part.parameters())
            if (param.device, param.dtype) != (self.device, self.dtype):
                raise InvalidRequest(f"model: the vision tower and projector must be on {self.device} "
                                     f"in {self.dtype} like the text, got {param.device} {param.dtype}")
        # One blank image: the processor's block must hold a placeholder per feature.
        probe = self._prepare(Image.new("RGB", (64, 48)), keep=False)
        if self.prefill_graphs:  # the tower as graphs where its input has one shape (tower_graphs)
            self._tower = TowerGraphs.make(model, probe.tensors, self._cap.max_rows,
                                           GraphSet(self.device, True, share_pool_of=self._decode_graphs),
                                           self.device, self.dtype)
            if self._tower is not None:
                with self._on(self._compute):
                    self._tower.capture()
                self._sync()
        with torch.no_grad():
            features = image_prefill.encode(self, [probe])[0]
        dim = model.text.get_input_embeddings().weight.shape[1]
        places = probe.block.count(model.image_token_id)
        if features.shape != (places, dim):
            raise InvalidRequest(f"model: its processor expands an image to {places} placeholders and its "
                                 f"tower gives features {tuple(features.shape)}; the text takes width {dim}")
        pin = self.device.type == "cuda"
        # Per slot (I4): image_prefill.Staging's parts: placeholders' indices
        # and KV slots (each at most a prefill's tokens), row slots and
        # deltas, 3-D rotary positions.
        size = self._cap.max_prefill_tokens * (5 if model.mrope else 2) + 2 * self._cap.max_rows
        self._where = [torch.zeros(size, dtype=torch.long, pin_memory=pin) for _ in (0, 1)]
        self._kept: list[list[VlmPixels]] = [[], []]  # per slot: pixels a copy may read (I4)
        self._sync()

    @property
    def prefill_path(self) -> str:
        tower = self._tower or "vision tower eager"
        return f"images: {tower}, packed prefill eager; text: {super().prefill_path}"

    # -- host side: callers' threads ---------------------------------------------------

    def image_ref(self, image: Image.Image | VlmPixels) -> ImageRef:
        """An RGB PIL image (``bubblefree.images.load_image``'s) or an
        ``encode_image`` of this backend -> the ``ImageRef`` a request
        carries: the head and the image's block. Thread safe: the processor
        runs here, on the caller's thread."""
        if isinstance(image, VlmPixels):
            if not image.made_by(self):
                raise InvalidRequest("image: encoded by another backend")
            source = image
        else:
            source = self._prepare(image, keep=False)
        return ImageRef(length=len(self.head) + len(source.block), source=source)

    def encode_image(self, image: Image.Image) -> VlmPixels:
        """An image to ask several questions of: processed now (thread
        safe); the first image prefill that uses it encodes it, and its
        prefix KV (a prefix LM's: its features) stays on the device for the
        next ones."""
        return self._prepare(image, keep=True)

    def _prepare(self, image: Any, keep: bool) -> VlmPixels:
        if not isinstance(image, Image.Image):
            raise InvalidRequest(f"image: must be a PIL image, got {type(image).__name__}")
        if image.mode != "RGB":
            raise InvalidRequest(f"image: must be RGB (bubblefree.images.load_image), got mode "
                                 f"{image.mode!r}")
        return prepare(self.processor, image, self.token, self.device.type == "cuda", self, keep,
                       rows=self.vl.mrope)

    # -- launch ----------------------------------------------------------------------

    def _check_launch(self, plan: StepPlan) -> None:
        if plan.kind is not StepKind.IMAGE_PREFILL:
            return
        for r in plan.rows:
            why, source = None, r.image.source
            if not isinstance(source, VlmPixels) or not source.made_by(self):
                why = f"an image source this backend did not make ({type(source).__name__})"
            elif r.image.length != len(self.head) + len(source.block):
                why = (f"image length {r.image.length}, its prefix is {len(self.head) + len(source.block)} "
                       "(the head and the image's block)")
            if why:
                raise PlanRejected(f"step {plan.step_id}: row of seq {r.seq_id}: {why}")

    def _prefix(self, inputs: list[np.ndarray]) -> np.ndarray | None:
        """Each row's prompt, attended both ways on a prefix LM (PaliGemma)."""
        return np.array([len(x) for x in inputs], dtype=np.int64) if self.vl.prefix_lm else None

    def _forward(self, s: DecodeSlot, plan: StepPlan) -> tuple[torch.Tensor, int]:
        if plan.kind is StepKind.PREFILL and self.vl.prefix_lm:
            inputs = [np.asarray(r.tokens, dtype=np.int64) for r in plan.rows]
            k, shape = self._runner.pack_prefill(plan, s.staging_np, inputs, self._prefix(inputs))
            meta = s.staging[:k].to(self.device, non_blocking=True)
            return self._runner.prefill_forward(meta, shape), bucket(len(plan.rows), self._rows)
        if plan.kind is not StepKind.IMAGE_PREFILL:
            if plan.kind is StepKind.PREFILL and self.vl.mrope:  # text only: no rotary delta
                image_prefill.set_deltas(self, image_prefill.Staging(self._where[s.index], self.device),
                                         plan, np.zeros(len(plan.rows), dtype=np.int64))
            return super()._forward(s, plan)
        return image_prefill.launch(self, s, plan)

    def _features(self, s: DecodeSlot, sources: list[VlmPixels]) -> torch.Tensor:
        """These rows' image features, concatenated ``[placeholders, D]``:
        the tower and projector over the images without features yet, each
        once however many rows share it (an encoded image); an encoded
        image on a prefix LM keeps what it got (elsewhere it keeps its
        prefix's KV instead, ``image_prefill``)."""
        self._kept[s.index] = list(sources)
        todo = list({id(src): src for src in sources if src.features is None}.values())
        computed = dict(zip(map(id, todo), image_prefill.encode(self, todo))) if todo else {}
        for src in todo:
            if src.keep and self.vl.prefix_lm:
                src.features = computed[id(src)]
        return torch.cat([computed.get(id(src), src.features) for src in sources])

    def _settle(self, s: DecodeSlot, failed: bool) -> None:
        """A step's end: a failed one's encoded images forget the features
        and the prefix KV it meant to make (the next step encodes them
        again)."""
        if failed:
            for source in self._kept[s.index]:
                source.features = source.kv = None
        self._kept[s.index] = []

    def _forward_failed(self, s: DecodeSlot) -> None:
        self._settle(s, True)

    def _released(self, s: DecodeSlot, failed: bool) -> None:
        self._settle(s, failed)
