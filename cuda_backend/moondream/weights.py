"""moondream2 from a local checkpoint directory, or with random weights.

A checkpoint directory holds ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``), optionally ``config.json`` and
``tokenizer.json``. Tensor names are this package's module paths, e.g.
``vision.blocks.0.attn.qkv.weight``, ``text.wte``,
``region.coord_features``, optionally under a ``model.`` prefix (the
layout of the transformers-hosted moondream2, whose wrapper holds the
network as ``model``). Every tensor must be present with its expected
shape; a mismatch raises and names the tensor, rather than leaving random
weights in a model that would then answer nonsense.

The older layout of moondream2's releases (``vision_encoder.encoder.model.
visual...``, ``text_model.transformer.h...``, ``region_model...``, each
name possibly with torch.compile's ``._orig_mod``) is renamed on reading
(``legacy_names``); its Fourier frequency matrices are stored transposed.

``config.json`` may override shapes under ``"config"``, in moondream's own
field names (``enc_dim``, ``enc_n_layers``, ...), which ``config_to_json``
also writes; the tokenizer's prompt templates too. Nothing is downloaded.

The weights come last: ``open_checkpoint`` reads and checks every other
part, so a bad config.json or tokenizer.json is refused before the model is
allocated on its device or a tensor is read; ``load_checkpoint`` then
allocates and reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from safetensors import safe_open
from torch import nn

from bubblefree.cuda_backend.errors import ModelLoadError
from bubblefree.cuda_backend.moondream.config import (MOONDREAM2, MoondreamConfig, RegionConfig,
                                                      TextConfig, TokenizerConfig, VisionConfig)
from bubblefree.cuda_backend.moondream.model import Moondream

# moondream's config field -> ours, per part; fields not listed are the same.
_RENAMES = {
    "vision": {"enc_dim": "dim", "enc_n_layers": "n_layers", "enc_n_heads": "n_heads",
               "enc_ff_dim": "ff_dim", "enc_patch_size": "patch_size"},
    "text": {}, "region": {}, "tokenizer": {},
}
_PARTS = {"vision": VisionConfig, "text": TextConfig, "region": RegionConfig,
          "tokenizer": TokenizerConfig}
# Fields of moondream's config this code runs without, as long as they are
# off: quantized linears (``group_size``).
_OFF_FIELDS = {"group_size"}

# The older checkpoint layout -> this package's names, first match wins.
_LEGACY = [(re.compile(a), b) for a, b in (
    (r"^vision_encoder\.encoder\.model\.visual\.patch_embed\.linear\.", "vision.patch_emb."),
    (r"^vision_encoder\.encoder\.model\.visual\.pos_embed$", "vision.pos_emb"),
    (r"^vision_encoder\.encoder\.model\.visual\.norm\.", "vision.post_ln."),
    (r"^vision_encoder\.encoder\.model\.visual\.blocks\.(\d+)\.norm(\d)\.", r"vision.blocks.\1.ln\2."),
    (r"^vision_encoder\.encoder\.model\.visual\.blocks\.", "vision.blocks."),
    (r"^vision_encoder\.projection\.mlp\.", "vision.proj_mlp."),
    (r"^text_model\.transformer\.embd\.wte\.weight$", "text.wte"),
    (r"^text_model\.lm_head\.ln\.", "text.post_ln."),
    (r"^text_model\.lm_head\.linear\.", "text.lm_head."),
    (r"^text_model\.transformer\.h\.(\d+)\.mixer\.Wqkv\.", r"text.blocks.\1.attn.qkv."),
    (r"^text_model\.transformer\.h\.(\d+)\.mixer\.out_proj\.", r"text.blocks.\1.attn.proj."),
    (r"^text_model\.transformer\.h\.", "text.blocks."),
    (r"^region_model\.coordinate_features\.weight$", "region.coord_features"),
    (r"^region_model\.size_features\.weight$", "region.size_features"),
    (r"^region_model\.coordinate_", "region.coord_"),
    (r"^region_model\.", "region."),
)]
_TRANSPOSED = ("region.coord_features", "region.size_features")  # [F, k] in the old layout


class CheckpointError(ModelLoadError):
    """A checkpoint directory that does not hold a moondream2 this code can run
    (a ``ModelLoadError``: the server reports it as one line, like any other)."""


# Shape fields that may be 0; every other number of the vision, text and
# region parts is a width, depth, count or scale, which 0 would break.
_MAY_BE_ZERO = {"overlap_margin"}


def config_from_json(overrides: dict) -> MoondreamConfig:
    """A ``MoondreamConfig`` from config.json's ``"config"``; every part and
    field checked, so a bad value is refused naming it rather than failing
    somewhere inside the model's construction."""
    if not isinstance(overrides, dict):
        raise CheckpointError(f'config.json: "config" must be an object, got {overrides!r:.60}')
    parts = {}
    for part, cls in _PARTS.items():
        given = overrides.get(part, {})
        if not isinstance(given, dict):
            raise CheckpointError(f"config.json: {part} must be an object, got {given!r:.60}")
        args = _part_args(part, cls, given)
        parts[part] = attrs.evolve(getattr(MOONDREAM2, part), **args)
    try:
        return MoondreamConfig(**parts)
    except ValueError as err:  # widths that do not fit together
        raise CheckpointError(f"config.json: {err}") from err


def _part_args(part: str, cls: type, given: dict) -> dict:
    fields = {f.name for f in attrs.fields(cls)}
    args = {}
    for key, value in given.items():
        name = _RENAMES[part].get(key, key)
        if name == "n_kv_heads":
            if value != given.get("n_heads", MOONDREAM2.text.n_heads):
                raise CheckpointError("grouped key/value heads (n_kv_heads) are not supported")
            continue
        if name in _OFF_FIELDS and name not in fields:
            if value is not None:
                raise CheckpointError(f"config.json: {part}.{key}={value!r} is not supported")
            continue
        if name not in fields:
            raise CheckpointError(f"config.json: unknown {part} field {key!r}")
        if name == "templates":
            value = _templates(value)
        else:
            _check_number(part, key, name, value)
        args[name] = value
    return args


def _check_number(part: str, key: str, name: str, value) -> None:
    """Every field but the templates is a number of the default's kind: a
    string or a 0 would fail later inside the model, naming no field."""
    default = getattr(getattr(MOONDREAM2, part), name)
    if value is None and default is None:  # coord_id, size_id: absent
        return
    kinds = (int,) if isinstance(default, int) or default is None else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "an integer" if kinds == (int,) else "a number"
        raise CheckpointError(f"config.json: {part}.{key} must be {what}, got {value!r:.60}")
    low = 0 if part == "tokenizer" or name in _MAY_BE_ZERO else None
    if (value < low) if low is not None else not value > 0:
        bound = ">= 0" if low is not None else "> 0"
        raise CheckpointError(f"config.json: {part}.{key} must be {bound}, got {value!r}")


def _templates(value) -> dict:
    """The prompt templates: lists of ids in JSON, tuples here (a frozen value)."""
    if not isinstance(value, dict):
        raise CheckpointError(f"config.json: tokenizer.templates must be an object, got {value!r:.60}")
    out = {}
    for skill, parts in value.items():
        if parts is not None and not isinstance(parts, dict):
            raise CheckpointError(f"config.json: tokenizer.templates.{skill} must be an object or null, "
                                  f"got {parts!r:.60}")
        out[skill] = None if parts is None else {k: _ids(f"{skill}.{k}", v) for k, v in parts.items()}
    return out


def _ids(where: str, ids) -> tuple[int, ...]:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"config.json: tokenizer.templates.{where} must be a list of token ids, "
                              f"got {ids!r:.60}")
    return tuple(ids)


def config_to_json(config: MoondreamConfig) -> dict:
    out = {}
    for part in ("vision", "text", "region"):
        back = {ours: theirs for theirs, ours in _RENAMES[part].items()}
        out[part] = {back.get(k, k): v for k, v in attrs.asdict(getattr(config, part)).items()}
    tok = config.tokenizer
    out["tokenizer"] = {"bos_id": tok.bos_id, "eos_id": tok.eos_id}
    out["tokenizer"].update({k: getattr(tok, k) for k in ("coord_id", "size_id") if getattr(tok, k) is not None})
    return out


def random_model(config: MoondreamConfig, seed: int = 0, std: float = 0.2,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Moondream:
    """Random weights from ``seed``: normal(0, std) everywhere, LayerNorm
    scales near 1 (a zero scale would hide bugs behind zeros)."""
    generator = torch.Generator().manual_seed(seed)
    model = Moondream(config)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, nn.LayerNorm)}
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if id(param) in norms else std * noise)
    return model.to(device=device, dtype=dtype).eval()


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; anything else is refused naming the file."""
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{file}: cannot read it as JSON: {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, got {type(value).__name__}")
    return value


def _tensor_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return _shards(index)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors file in {directory}")
    return files


def _shards(index: Path) -> list[Path]:
    """The shards ``index``'s weight_map names, each of them present."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard files")
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    absent = [s.name for s in shards if not s.is_file()]
    if absent:
        raise CheckpointError(f"{index}: lists shards that are not in {index.parent}: {absent[:3]}")
    return shards


def legacy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of the older moondream2 layout under this package's names
    (the Fourier frequencies transposed back); other names pass unchanged."""
    out = {}
    for name, tensor in state.items():
        key = name.replace("._orig_mod", "")
        for pattern, repl in _LEGACY:
            key, hit = pattern.subn(repl, key)
            if hit:
                break
        if key in _TRANSPOSED and key != name:
            tensor = tensor.T
        if key in out:
            raise CheckpointError(f"tensor {key!r} appears twice")
        out[key] = tensor
    return out


def _read_state(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for file in files:
        for name, tensor in _read_file(file).items():
            key = name.removeprefix("model.")
            if key in state:
                raise CheckpointError(f"tensor {key!r} appears twice")
            state[key] = tensor
    return legacy_names(state)


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    return _opened(file, lambda f: {name: f.get_tensor(name) for name in f.keys()})


def _header(file: Path) -> list[str]:
    """The tensor names ``file``'s header lists; opening it checks that the
    header parses and that the file is as long as it says (no tensor read)."""
    return _opened(file, lambda f: list(f.keys()))


def _opened(file: Path, read: Callable[[Any], Any]) -> Any:
    # safetensors raises its own SafetensorError (empty, truncated, bad
    # header), which names neither the file nor a load failure.
    try:
        with safe_open(str(file), framework="pt") as f:
            return read(f)
    except Exception as err:  # noqa: BLE001 - any failure here is a bad file
        raise CheckpointError(f"{file}: cannot read it as safetensors: {err}") from err


def load_state(model: Moondream, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``; every tensor present, known, same shape."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise CheckpointError(f"checkpoint does not match moondream2: missing {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}, unknown {unknown[:5]}"
                              f"{' ...' if len(unknown) > 5 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(expected[name].shape)}")
    model.load_state_dict(state, strict=True)


@attrs.frozen
class LoadedMoondream:
    model: Moondream
    config: MoondreamConfig
    tokenizer: object | None     # a ``tokenizers.Tokenizer`` where tokenizer.json exists


@attrs.frozen
class MoondreamCheckpoint:
    """A checkpoint directory's every part but its weights, each checked."""

    directory: Path
    files: tuple[Path, ...]      # the safetensors, present; not yet read
    config: MoondreamConfig
    tokenizer: object | None     # as ``LoadedMoondream.tokenizer``


def open_checkpoint(directory: str | Path) -> MoondreamCheckpoint:
    """The tensor files' names, config.json and tokenizer.json, checked: a
    bad one would otherwise be found only after the weights were allocated
    and read (GBs of device memory). Reads no weight; allocates nothing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    files = tuple(_tensor_files(directory))
    for file in files:  # a file cut short is found from its header, not after the allocation
        _header(file)
    config = MOONDREAM2
    config_file = directory / "config.json"
    if config_file.is_file():
        try:
            config = config_from_json(_read_json(config_file).get("config", {}))
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint {directory}: {err}") from None
    return MoondreamCheckpoint(directory, files, config, _tokenizer(directory / "tokenizer.json"))


def load_checkpoint(source: str | Path | MoondreamCheckpoint, dtype: torch.dtype = torch.float16,
                    device: str | torch.device = "cpu") -> LoadedMoondream:
    """``source``: a directory, or one ``open_checkpoint`` has checked; its
    weights are allocated and read last."""
    checkpoint = source if isinstance(source, MoondreamCheckpoint) else open_checkpoint(source)
    model = _meta_model(checkpoint.config, checkpoint.directory / "config.json")
    # Allocated once, in the target dtype: a float32 copy of moondream2
    # would be 7.5 GB. The checkpoint's tensors are cast as they copy in.
    model = model.to_empty(device=device).to(dtype)
    state = _read_state(list(checkpoint.files))
    try:
        load_state(model, state)
    except CheckpointError as err:  # which checkpoint, for a server's one-line report
        raise CheckpointError(f"checkpoint {checkpoint.directory}: {err}") from None
    return LoadedMoondream(model=model.eval(), config=checkpoint.config, tokenizer=checkpoint.tokenizer)


def _meta_model(config: MoondreamConfig, config_file: Path) -> Moondream:
    """The model's modules on the meta device; widths that every field
    allows alone may still not fit together (heads that do not divide)."""
    try:
        with torch.device("meta"):
            return Moondream(config)
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError) as err:
        raise CheckpointError(f"{config_file}: its config does not make a model: {err}") from err


def _tokenizer(file: Path):
    if not file.is_file():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises its own kinds
        raise CheckpointError(f"{file}: cannot read it as a tokenizer: {err}") from err
