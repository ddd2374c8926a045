"""Compiling a tile program: for the CPU (target ``c``, a shared library called through TileLang's Cython
adapter) or to CUDA C++ for an NVIDIA architecture (``cuda_source``; nvcc then builds it, here in the tests
and on a GPU by TileLang's own JIT). Compiled kernels are kept per process (``functools.cache`` on the
program's parameters) and on disk in ``TILELANG_CACHE_DIR`` (TileLang's own cache; the tests point it at a
folder of their own)."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import tilelang
from tvm.target import Target

from . import dialect

__all__ = ["cpu_kernel", "cuda_kernel", "cuda_source", "CPU_FLAGS"]

#: The C compiler's flags for CPU kernels. TileLang's default is none (-O0); -O2 without -march keeps
#: every fp32 operation a separate IEEE operation (no FMA contraction on baseline x86-64), so the results
#: are the program's own arithmetic, bit for bit, on any x86-64 machine.
CPU_FLAGS = ["-O2", "-fno-fast-math"]

logging.getLogger("tilelang").setLevel(logging.WARNING)  # one INFO line per compiled kernel otherwise


@functools.cache
def cpu_kernel(program: Callable[..., Any], *params: Any) -> Any:
    """``program(dialect.CPU, *params)`` compiled for the CPU; called with torch CPU tensors (narrow floats
    viewed as their integer storage, ``Dialect.storage``) and scalars, in the program's argument order."""
    return tilelang.compile(program(dialect.CPU, *params), target="c", compile_flags=CPU_FLAGS)


def cuda_source(program: Callable[..., Any], arch: str, *params: Any) -> tuple[str, Any]:
    """(CUDA C++ source, lowered device module) of ``program(dialect.CUDA, *params)`` for ``arch``
    (``sm_90``, ``sm_100``): TileLang's lowering only, which needs no GPU."""
    target = {"kind": "cuda", "arch": arch}
    with Target(target):
        artifact = tilelang.lower(program(dialect.CUDA, *params), target=target)
    return artifact.kernel_source, artifact.device_mod


@functools.cache
def cuda_kernel(program: Callable[..., Any], *params: Any) -> Any:
    """``program(dialect.CUDA, *params)`` compiled by TileLang's JIT for the current GPU (nvcc); called with
    torch CUDA tensors. Never run yet: no GPU was available (docs/tilelang.md)."""
    return tilelang.compile(program(dialect.CUDA, *params), target="cuda")
