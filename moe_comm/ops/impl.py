"""Which implementation of an op runs (``impl=``): ``native`` (the device's fast path: ``moe_comm._C`` or
torch ops), ``triton`` (the one Triton source every vendor's Triton compiles) or ``tilelang`` (one TileLang
tile program per op, built for the CPU or CUDA; the ops that carry an MoE layer's FLOPs and bytes, see
``TILELANG_OPS``). The plain-torch ``*_reference`` of each op is its specification, not an implementation
to pick."""
from __future__ import annotations

import functools
import importlib
import re
import warnings
from types import ModuleType
from typing import Optional

import torch

from ..core import env

__all__ = ["IMPLS", "TILELANG_OPS", "TILELANG_MISSING_FORMATS", "TILELANG_RANGE", "resolve", "renamed_impl",
           "triton_usable", "tilelang_usable", "tilelang_covers", "interpreter_problem", "kernels", "tilelang_programs",
           "next_pow2"]

#: The implementations an op can run with (``impl=``).
IMPLS = ("native", "triton", "tilelang")

#: The ops with a TileLang program; ``impl="tilelang"`` for another op is a ValueError naming these.
TILELANG_OPS = ("permute", "quantize", "dequantize", "unpermute_reduce", "grouped_gemm", "expert_ffn")

#: The cast formats the TileLang programs have no code for (they cast to FP8 only).
TILELANG_MISSING_FORMATS = ("int8",)

#: The TileLang releases the ``tilelang`` extra admits (pyproject.toml; `make test` runs the lowest).
TILELANG_RANGE = ((0, 1, 15), (0, 2, 0))


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> Optional[str]:
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return f"triton does not import ({exc}); install it with `pip install moe-comm[triton]`"
    return None


def _release(version: str) -> tuple[int, int]:
    major, minor = (re.findall(r"\d+", version) + ["0", "0"])[:2]
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> Optional[str]:
    """Why Triton's CPU interpreter cannot run with the installed Triton and numpy, or None. Interpreters
    before Triton 3.7 call int() on one-element arrays (every ``range`` over a kernel argument), which
    numpy 2.4 refuses; compiled kernels do not use numpy."""
    if _triton_import_error() is not None:
        return _triton_import_error()
    import numpy
    import triton
    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter needs numpy<2.4, found numpy {numpy.__version__}: "
                f"install 'numpy<2.4' or triton>=3.7")
    return None


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """Whether Triton kernels can run on ``device``, and why not. CPU tensors need Triton's interpreter
    (``TRITON_INTERPRET=1`` before the kernels are first imported); a device needs a Triton backend."""
    error = _triton_import_error()
    if error is not None:
        return False, error
    if device.type == "cpu" and not env.triton_interpret():
        return False, "Triton runs on CPU tensors only in its interpreter: set TRITON_INTERPRET=1 before starting"
    if device.type == "cpu" and interpreter_problem() is not None:
        return False, interpreter_problem()
    if device.type != "cpu" and env.triton_interpret():
        return False, f"TRITON_INTERPRET=1 is set, so Triton would interpret, not compile, for {device.type} tensors"
    return True, ""


@functools.lru_cache(maxsize=None)
def _tilelang_problem() -> Optional[str]:
    try:
        tilelang = importlib.import_module("tilelang")
    except ImportError as exc:
        return f"tilelang does not import ({exc}); install it with `pip install moe-comm[tilelang]`"
    version = tuple(int(part) for part in re.findall(r"\d+", tilelang.__version__)[:3])
    low, high = TILELANG_RANGE
    if not low <= version < high:
        return (f"tilelang {tilelang.__version__} is outside the tested range >={'.'.join(map(str, low))},"
                f"<{'.'.join(map(str, high))}: install it with `pip install moe-comm[tilelang]`")
    return None


def tilelang_usable(device: torch.device) -> tuple[bool, str]:
    """Whether the TileLang programs can run on ``device`` (CPU: target ``c``; CUDA), and why not."""
    error = _tilelang_problem()
    if error is not None:
        return False, error
    if device.type not in ("cpu", "cuda"):
        return False, f"the TileLang programs are built for cpu and cuda tensors, not {device.type}"
    return True, ""


def tilelang_covers(op: str, fmt: Optional[str] = None) -> bool:
    """Whether ``op`` has a TileLang program, for the cast format ``fmt`` where the op casts (None: no cast)."""
    return op in TILELANG_OPS and fmt not in TILELANG_MISSING_FORMATS


def renamed_impl(op: str, name: str, impl: Optional[str], backend: Optional[str]) -> Optional[str]:
    """The ops implementation a call asks for as ``name`` (``impl`` or ``ops_impl``), taking ``backend``, the
    keyword's old name, with a DeprecationWarning (``backend=`` now only names a Buffer backend); a
    ValueError when both are given and differ."""
    if backend is None:
        return impl
    warnings.warn(f"{op}: the keyword backend= is deprecated, use {name}= (backend= names a Buffer backend)",
                  DeprecationWarning, stacklevel=3)  # the line that called the public function
    if impl is not None and impl != backend:
        raise ValueError(f"{op}: {name}={impl!r} and its deprecated name backend={backend!r} disagree")
    return backend


def resolve(op: str, device: torch.device, impl: Optional[str], backend: Optional[str] = None) -> str:
    """The implementation ``op`` runs with on ``device``: ``impl`` if given, else ``MOE_COMM_OPS_IMPL``,
    else ``native`` on CPU and ``triton`` elsewhere when usable. ``backend`` is the keyword's old name:
    accepted with a DeprecationWarning, and a ValueError when it disagrees with ``impl``. Raises
    ValueError for an unknown name, or a Triton or TileLang request that cannot run, naming why; an op
    without a TileLang program (not in ``TILELANG_OPS``) runs ``native`` when the variable names
    ``tilelang`` and raises when ``impl`` does."""
    impl = renamed_impl(op, "impl", impl, backend)
    source = "impl"
    if impl is None:
        impl, source = env.ops_impl()
    if impl is None:
        return "triton" if device.type != "cpu" and triton_usable(device)[0] else "native"
    if impl not in IMPLS:
        raise ValueError(f"{op}: {source} must be one of {list(IMPLS)}, got {impl!r}")
    if impl == "tilelang" and source != "impl" and op not in TILELANG_OPS:
        return "native"  # the variable picks TileLang wherever it has a program (docs/tilelang.md)
    if impl == "triton":
        usable, why = triton_usable(device)
        if not usable:
            raise ValueError(f"{op}: impl 'triton' cannot run on {device.type} tensors: {why}")
    if impl == "tilelang":
        if op not in TILELANG_OPS:
            raise ValueError(f"{op}: impl 'tilelang' has no program for this op; it has one for {list(TILELANG_OPS)}")
        usable, why = tilelang_usable(device)
        if not usable:
            raise ValueError(f"{op}: impl 'tilelang' cannot run on {device.type} tensors: {why}")
    return impl


@functools.lru_cache(maxsize=None)
def kernels(name: str) -> ModuleType:
    """The torch-free Triton kernel module ``moe_comm.ops.triton.<name>``, imported on first use so that
    importing moe_comm never needs Triton."""
    return importlib.import_module(f"{__package__}.triton.{name}")


@functools.lru_cache(maxsize=None)
def tilelang_programs(name: str) -> ModuleType:
    """The torch-free TileLang program module ``moe_comm.ops.tilelang.<name>``, imported on first use so that
    importing moe_comm never needs TileLang."""
    return importlib.import_module(f"{__package__}.tilelang.{name}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, (n - 1).bit_length())
