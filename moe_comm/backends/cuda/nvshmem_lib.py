"""Loading ``moe_comm._cuda_nvshmem`` (``csrc/cuda/nvshmem``: NVSHMEM's host API and kernels on its
device API) with one clear error when it cannot serve.

The module links NVSHMEM's device library (``libnvshmem_device.a``, the version it was built against:
``BUILD_VERSION``) and needs NVSHMEM's host library ``libnvshmem_host.so.3`` at run time, from the
``nvidia-nvshmem-cu13`` wheel. How that library is found:

- The module's RUNPATH is ``$ORIGIN/../nvidia/nvshmem/lib``: installed in ``site-packages/moe_comm/``, it
  finds the wheel in the same ``site-packages`` (the primary mechanism).
- Before importing it, :func:`load` preloads ``libnvshmem_host.so.3`` (``RTLD_GLOBAL``) from the lib
  folder of the importable ``nvidia.nvshmem`` package, so an install where the two are not siblings
  (another site-packages, a relocated module) still works: the loader then reuses the library already
  loaded under that soname.
- NVSHMEM's bootstrap plugin for unique-id init, ``nvshmem_bootstrap_uid.so.3`` (also its transports),
  is ``dlopen``'ed by bare name by the host library, whose ``DT_RPATH`` is ``${ORIGIN}`` (checked with
  ``readelf -d`` on 3.4.5): it is found next to ``libnvshmem_host.so.3`` in the wheel, wherever that was
  loaded from. ``NVSHMEM_BOOTSTRAP_UID_PLUGIN`` (environment) overrides the name or path. Verified here:
  ``unique_id()`` (no GPU needed) maps ``nvshmem_bootstrap_uid.so.3`` from the wheel's lib folder.

Compatibility: a host library works with a device library of the same major version and the same or
an earlier version (:func:`version_problem`).

This file imports no torch of its own. Neither it nor :func:`load` makes a CUDA call or an NVSHMEM call
that needs a GPU: both work on a machine without one.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence

__all__ = ["NvshmemUnavailableError", "HOST_LIBRARY", "MODULE", "load", "available", "version_problem",
           "build_info_of", "wheel_name", "preload_host_library"]

#: The extension this loads.
MODULE = "moe_comm._cuda_nvshmem"
#: NVSHMEM's host library (soname; the wheel ships no unversioned .so).
HOST_LIBRARY = "libnvshmem_host.so.3"
#: The CUDA major version assumed when the build's cannot be read (the project builds with CUDA 13).
DEFAULT_CUDA_MAJOR = 13

_BUILD_HINT = ("it is built when nvcc and the nvidia-nvshmem wheel are found at build time (CMake option "
               "MOE_COMM_NVSHMEM=AUTO, the default); moe_comm.build_info()['cuda_nvshmem_not_built'] says why "
               "it was not. To build it: MOE_COMM_NVSHMEM_WHEEL=cu13 pip install '.[cu13]' (cu12 for CUDA 12; "
               "an isolated build then installs the NVSHMEM wheel for itself), or pip install "
               "'nvidia-nvshmem-cu13>=3.4.5' and rebuild with CMAKE_ARGS=-DMOE_COMM_NVSHMEM=ON pip install "
               "--no-build-isolation . (or set NVSHMEM_DIR to an NVSHMEM tree); docs/install.md")

_lock = threading.Lock()
_preloaded: dict[Path, ctypes.CDLL] = {}  # kept open for the life of the process


class NvshmemUnavailableError(RuntimeError):
    """``moe_comm._cuda_nvshmem`` cannot be used here; the message says why and what to install or
    rebuild."""


def _fmt(version: Sequence[int]) -> str:
    return ".".join(str(int(v)) for v in version)


def wheel_name(cudart_version: Optional[int] = None) -> str:
    """The nvidia-nvshmem wheel for a build with this CUDA runtime (``CUDART_VERSION``, 13000 for 13.0):
    ``nvidia-nvshmem-cu13``; the project's default CUDA major when unknown."""
    major = cudart_version // 1000 if cudart_version else DEFAULT_CUDA_MAJOR
    return f"nvidia-nvshmem-cu{major}"


def version_problem(build: Sequence[int], runtime: Sequence[int], cudart_version: Optional[int] = None
                    ) -> Optional[str]:
    """None when an NVSHMEM host library of version ``runtime`` serves a module built against
    ``build`` (same major version, runtime >= build, as (major, minor, patch)); otherwise why not,
    naming both versions and the wheel to install. The rule of the module's own ``incompatibility()``
    (runtime.cpp), which init() enforces too."""
    b, r = tuple(int(v) for v in build[:3]), tuple(int(v) for v in runtime[:3])
    wheel = wheel_name(cudart_version)
    both = (f"moe_comm._cuda_nvshmem was built against NVSHMEM {_fmt(b)} and the loaded host library "
            f"{HOST_LIBRARY} is NVSHMEM {_fmt(r)}")
    if r[0] != b[0]:
        return f"{both}: the major versions differ (pip install '{wheel}>={_fmt(b)},<{b[0] + 1}')"
    if r < b:
        return f"{both}: the host library is older than the build (pip install '{wheel}>={_fmt(b)}')"
    return None


def build_info_of(path: str | os.PathLike[str]) -> tuple[Optional[tuple[int, int, int]], Optional[int]]:
    """(NVSHMEM version, CUDART_VERSION) a built ``_cuda_nvshmem`` file was compiled against, read from
    the file (runtime.cpp embeds them as text) without loading it; None for what is not there."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None, None
    m = re.search(rb"MOE_COMM_NVSHMEM_BUILD_VERSION=(\d+)\.(\d+)\.(\d+);(?:CUDART_VERSION=(\d+);)?", data)
    if not m:
        return None, None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))), (int(m.group(4)) if m.group(4) else None)


def _wheel_lib_dirs() -> list[Path]:
    """The lib folders of the importable ``nvidia.nvshmem`` package (a namespace package: every entry
    of its ``__path__`` that has the host library)."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) / "lib" for p in spec.submodule_search_locations if (Path(p) / "lib" / HOST_LIBRARY).is_file()]


def preload_host_library() -> Optional[str]:
    """Loads ``libnvshmem_host.so.3`` with ``RTLD_GLOBAL`` from the ``nvidia.nvshmem`` package when it is
    importable (once per process); returns the path loaded, or None (no such package, or it failed to
    load: the module's RUNPATH is then the only way left)."""
    for lib_dir in _wheel_lib_dirs():
        path = lib_dir / HOST_LIBRARY
        if path not in _preloaded:
            try:
                _preloaded[path] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
        return str(path)
    return None


def _import() -> ModuleType:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.origin:
        raise NvshmemUnavailableError(f"{MODULE} was not built: {_BUILD_HINT}")
    try:
        return importlib.import_module(MODULE)
    except ImportError as exc:
        text = str(exc)
        if HOST_LIBRARY in text:
            build, cudart = build_info_of(spec.origin)
            want = f"{wheel_name(cudart)}>={_fmt(build)}" if build else wheel_name(cudart)
            raise NvshmemUnavailableError(
                f"{MODULE} needs NVSHMEM's host library {HOST_LIBRARY}, which cannot be loaded ({text}). "
                f"Install it: pip install '{want}' (the module looks in ../nvidia/nvshmem/lib beside its "
                f"own folder, and in the lib folder of an importable nvidia.nvshmem package)") from exc
        raise NvshmemUnavailableError(f"{MODULE} ({spec.origin}) failed to import: {text}") from exc


def load() -> ModuleType:
    """``moe_comm._cuda_nvshmem``, imported, with a host library it can use: same major NVSHMEM version
    as the build and not older. Raises :class:`NvshmemUnavailableError` (one type for every reason: not
    built, host library missing, versions) otherwise. Makes no CUDA or NVSHMEM call that needs a GPU."""
    with _lock:
        preload_host_library()
        module = _import()
    problem = version_problem(module.BUILD_VERSION, module.runtime_version(), module.BUILD_CUDART_VERSION)
    if problem is not None:
        raise NvshmemUnavailableError(problem)
    return module


def available() -> Optional[str]:
    """None when :func:`load` succeeds, else its error message."""
    try:
        load()
    except NvshmemUnavailableError as exc:
        return str(exc)
    return None
