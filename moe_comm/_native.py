"""Access to the native extension ``moe_comm._C``; says what was built instead of guessing."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from . import env

__all__ = ["native", "build_info", "require", "cpu_threads"]


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
