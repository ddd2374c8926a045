"""Access to the native extension ``moe_comm._C``; says what was built instead of guessing.

The kernels' codes are C++ enums bound in ``_C`` (``DType``, ``QuantFormat``, ``IsaLevel``,
``WaitOutcome``); Python passes their members, never integers. ``native_dtype`` and ``native_format``
are the one place torch dtypes become members.
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from . import env

__all__ = ["native", "build_info", "require", "cpu_threads", "NATIVE_DTYPES", "native_dtype", "native_format"]

# torch dtype -> name of its member of moe_comm._C.DType (csrc/cpu/api.h)
_DTYPES = {torch.float32: "kFloat32", torch.bfloat16: "kBFloat16", torch.float16: "kFloat16"}
# dtype of the codes -> name of its member of moe_comm._C.QuantFormat
_FORMATS = {torch.float8_e4m3fn: "kE4M3", torch.float8_e5m2: "kE5M2", torch.int8: "kInt8"}

#: The float dtypes the CPU kernels read and write, for checks that need not load ``_C``.
NATIVE_DTYPES = tuple(_DTYPES)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str]:
    try:
        from . import _C  # type: ignore[attr-defined]
    except ImportError as exc:  # reported by require() with the import error
        return None, str(exc)
    return _C, ""


def build_info() -> dict[str, Any]:
    """What this build contains: ``{"cpu": bool, "cuda": bool, "ascend": bool, "bang": bool, ...}``.

    All False (plus ``"error"``) when the extension is missing.
    """
    module, error = _load()
    if module is None:
        return {"cpu": False, "cuda": False, "ascend": False, "bang": False, "error": error}
    return dict(module.build_info())


def require(feature: str, needed_for: str) -> ModuleType:
    """Returns ``moe_comm._C`` if it was built with ``feature``, else raises RuntimeError saying so."""
    module, error = _load()
    if module is None:
        raise RuntimeError(f"{needed_for} needs the native extension moe_comm._C, which failed to import "
                           f"({error}); build it with `pip install .` (or `make test`)")
    info = module.build_info()
    if not info.get(feature, False):
        built = sorted(k for k in ("cpu", "cuda", "ascend", "bang") if info.get(k))
        raise RuntimeError(f"{needed_for} needs moe_comm._C built with {feature!r}; this build has {built}")
    return module


@functools.lru_cache(maxsize=None)
def native() -> ModuleType:
    """The CPU kernels (``moe_comm._C``); raises RuntimeError if the extension is missing."""
    return require("cpu", "a CPU tensor operation")


@functools.lru_cache(maxsize=None)
def cpu_threads() -> int:
    """Threads the CPU kernels use: ``MOE_COMM_NUM_THREADS`` or all hardware threads."""
    return env.num_threads() or native().hardware_threads()


def native_dtype(dtype: torch.dtype) -> Any:
    """The ``moe_comm._C.DType`` member of ``dtype``, one of NATIVE_DTYPES; ValueError for any other."""
    if dtype not in _DTYPES:
        raise ValueError(f"native_dtype: the CPU kernels take {list(NATIVE_DTYPES)}, got {dtype}")
    return getattr(native().DType, _DTYPES[dtype])


def native_format(dtype: torch.dtype) -> Any:
    """The ``moe_comm._C.QuantFormat`` member whose codes have ``dtype`` (float8_e4m3fn, float8_e5m2 or int8);
    ValueError for any other."""
    if dtype not in _FORMATS:
        raise ValueError(f"native_format: the CPU kernels write codes of {list(_FORMATS)}, got {dtype}")
    return getattr(native().QuantFormat, _FORMATS[dtype])
