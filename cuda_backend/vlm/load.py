"""Loading a local transformers vision-language checkpoint, offline.

The directory holds what the model's own processor needs: config.json,
safetensors, the tokenizer, the image processor's and the processor's
configs, and a chat template (the tokenizer's, or the processor's
``chat_template.json`` / ``.jinja``). Every refusal is a ``ModelLoadError`` or ``UnsupportedModel``
naming the directory and what is missing.

The weights are read last: every part that can refuse the directory without
them (``open_vision_language``) is loaded and checked first, so a broken
tokenizer or processor costs no weight load and puts nothing on the device.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from bubblefree.cuda_backend.errors import ModelLoadError, UnsupportedModel
from bubblefree.cuda_backend.loader import default_device, default_dtype, load_weights, refuse_custom_code
from bubblefree.cuda_backend.quiet import quiet_transformers
from bubblefree.cuda_backend.vlm.model import (MROPE, TEMPLATES, VisionLanguage, feature_count, supported,
                                               tile_features)
from bubblefree.cuda_backend.vlm.pixels import TokenRepeat


@attrs.define(eq=False)
class LoadedVision:
    model: VisionLanguage
    processor: Any  # the model's processor: its tokenizer (chat template set) and image processor
    image_token: tuple[int, str]  # the placeholder's id and text

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer


@attrs.frozen
class VisionCheckpoint:
    """A checkpoint directory's every part but its weights, each checked."""

    path: Path
    config: Any
    processor: Any  # as ``LoadedVision.processor``
    image_token: tuple[int, str]

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer


def load_vision_language(source: str | Path | VisionCheckpoint, *, device: Any = None,
                         dtype: Any = None) -> LoadedVision:
    """``source``: a directory, or one ``open_vision_language`` has checked.
    Its weights are read last; ``VisionLanguage.of`` then checks what only
    the loaded module tells (its architecture as built, where its language
    model sits)."""
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    checkpoint = source if isinstance(source, VisionCheckpoint) else open_vision_language(source)
    vlm = load_weights(AutoModelForImageTextToText, checkpoint.path, config=checkpoint.config, dtype=dtype)
    vlm.eval().to(device)
    return LoadedVision(VisionLanguage.of(vlm), checkpoint.processor, checkpoint.image_token)


def open_vision_language(path: str | Path) -> VisionCheckpoint:
    """Everything that can refuse the directory without its weights: a bad
    tokenizer or processor would otherwise be found only after a load of
    minutes and GBs of device memory. Reads no weight; allocates nothing."""
    path = Path(path)
    config = _config(path)
    processor = _processor(path, config)
    tokenizer = processor.tokenizer
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:  # ids past the embeddings: as a text model
        raise ModelLoadError(f"model directory {path}: its tokenizer has {len(tokenizer)} tokens and "
                             f"its language model {vocab} embeddings: they are not one checkpoint's")
    token_id = int(config.image_token_id)
    if not 0 <= token_id < len(tokenizer):
        raise ModelLoadError(f"model directory {path}: image_token_id {token_id} is not one of the "
                             f"tokenizer's {len(tokenizer)} ids")
    token = tokenizer.convert_ids_to_tokens(token_id)
    if config.model_type == "paligemma":  # the block: its placeholders, then the BOS it writes after them
        processor = TokenRepeat(processor.image_processor, tokenizer, token_id,
                                lambda _, n=processor.image_seq_length: n, after=(tokenizer.bos_token_id,))
    return VisionCheckpoint(path, config, processor, (token_id, token))


def _config(path: Path) -> Any:
    try:  # the type first: another architecture's config may not even parse as its own
        raw = json.loads((path / "config.json").read_text())
        refuse_custom_code(path, raw)
        model_type = raw.get("model_type")
        why = supported(str(model_type))
        if why:
            raise UnsupportedModel(f"{path}: {why}")
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except ModelLoadError:  # UnsupportedModel too
        raise
    except Exception as ex:  # noqa: BLE001 - any failure here is a bad directory
        raise ModelLoadError(f"model directory {path}: cannot read config.json: {ex}") from ex


def _processor(path: Path, config: Any) -> Any:
    """The model's processor, with a tokenizer, an image processor and a chat template."""
    with quiet_transformers():
        try:
            processor = AutoProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as ex:  # noqa: BLE001
            processor = _image_only(path, config, ex)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or getattr(processor, "image_processor", None) is None:
        raise ModelLoadError(f"model directory {path}: its processor ({type(processor).__name__}) has no "
                             "tokenizer or no image processor")
    if not getattr(tokenizer, "chat_template", None):  # LLaVA checkpoints keep it with the processor
        tokenizer.chat_template = getattr(processor, "chat_template", None) or TEMPLATES.get(config.model_type)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"model directory {path}: has no chat template (the tokenizer's, or "
                             "chat_template.json); it places the image in the prompt")
    return processor


def _image_only(path: Path, config: Any, why: Exception) -> Any:
    """A processor's image part, where the processor itself cannot load here:
    Qwen2-VL's, Qwen2.5-VL's and SmolVLM2's also want a video processor,
    which needs torchvision (and SmolVLM2's num2words). The Qwens' is the
    image processor and the image token once per feature; SmolVLM2 expands
    an image exactly as Idefics3 does (the same row, column and wrapper
    tokens), so Idefics3's processor around its image processor."""
    if config.model_type not in (*MROPE, "smolvlm"):
        raise ModelLoadError(f"model directory {path}: cannot load its processor (tokenizer and image "
                             f"processor): {why}") from why
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        images = AutoImageProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as ex:  # noqa: BLE001
        raise ModelLoadError(f"model directory {path}: cannot load its tokenizer and image processor: "
                             f"{ex}") from ex
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _template_file(path)
    if config.model_type == "smolvlm":
        from transformers import Idefics3Processor

        return Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                 image_seq_len=tile_features(config), chat_template=tokenizer.chat_template)
    return TokenRepeat(images, tokenizer, int(config.image_token_id), functools.partial(feature_count, config))


def _template_file(path: Path) -> str | None:
    """The processor's chat template, read from its file."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return None
