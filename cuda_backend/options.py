"""The backend's options, checked in one place before anything is built.

``Engine.from_pretrained(**options)`` checks them before a model is loaded
and ``CudaBackend(...)`` before it takes any memory, so a bad value is
refused with ``InvalidRequest`` naming the option rather than a
``TypeError`` from deep inside the build. bool is not an int here:
``max_rows=True`` is a caller's bug, not 1.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from bubblefree.core.values import InvalidRequest, shown
from bubblefree.cuda_backend.errors import CacheTooSmall
from bubblefree.cuda_backend.kernel_config import KernelConfig

Check = Callable[[str, Any], None]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int, *, optional: bool = False, error: type[InvalidRequest] = InvalidRequest) -> Check:
    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if not _is_int(value) or value < low:
            also = " or None" if optional else ""
            raise error(f"{name}: must be an int >= {low}{also}, got {shown(value)}")
    return check


def flag(*, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> None:
        if not (isinstance(value, bool) or (value is None and optional)):
            also = " or None" if optional else ""
            raise InvalidRequest(f"{name}: must be True or False{also}, got {shown(value)}")
    return check


def kernel_config(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, KernelConfig):
        raise InvalidRequest(f"{name}: must be a KernelConfig or None, got {shown(value)}")


def fraction(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and 0.0 < value <= 1.0):
        raise InvalidRequest(f"{name}: must be a number in (0, 1], got {shown(value)}")


# CudaBackend's keyword options; tests check these names against its signature.
BACKEND_OPTIONS: Mapping[str, Check] = {
    "page_size": integer(1),
    "num_pages": integer(1, optional=True, error=CacheTooSmall),
    "kv_memory_fraction": fraction,
    "max_rows": integer(1),
    "max_seqs": integer(1),
    "max_prefill_tokens": integer(1),
    "max_context": integer(1, optional=True),
    "use_graphs": flag(),
    "prefill_graphs": flag(),
    "compile_decode": flag(optional=True),
    "fused_decode": flag(),
    "token_prefill": integer(0, optional=True),
    "kernels": kernel_config,
    "min_graph_context": integer(1),
    "mask_capacity": integer(1),
}


def check_backend_options(options: Mapping[str, Any]) -> None:
    """Raise ``InvalidRequest`` for an unknown option or a bad value."""
    for name, value in options.items():
        check = BACKEND_OPTIONS.get(name)
        if check is None:
            raise InvalidRequest(f"{name}: unknown option; expected one of "
                                 f"{', '.join(BACKEND_OPTIONS)}")
        check(name, value)


def check_device(value: Any) -> torch.device | None:
    """``None`` (CUDA when present), a ``torch.device``, or a string naming one."""
    if value is None:
        return None
    if not isinstance(value, (str, torch.device)):
        raise InvalidRequest(f"device: must be a string such as 'cpu' or 'cuda:0', "
                             f"a torch.device or None, got {shown(value)}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as ex:
        raise InvalidRequest(f"device: {shown(value)} is not a device: {ex}") from ex
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device: {shown(value)}, but this machine has no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"device: must be a CPU or CUDA device, got {shown(value)}")
    return device


FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_dtype(value: Any) -> torch.dtype | None:
    """``None`` (bfloat16 on CUDA, float32 on the CPU), or a floating
    ``torch.dtype`` or its name."""
    if value is None:
        return None
    dtype = FLOAT_DTYPES.get(value) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES.values():
        raise InvalidRequest(f"dtype: must be one of {', '.join(FLOAT_DTYPES)} "
                             f"(or the torch dtype) or None, got {shown(value)}")
    return dtype
