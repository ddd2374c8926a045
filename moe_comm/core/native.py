"""Access to the native extensions (``moe_comm._C``, the CPU kernels; ``moe_comm._cuda``, the device
build of ``csrc/cuda``); says what was built instead of guessing.

The kernels' codes are C++ enums bound in ``_C`` (``DType``, ``QuantFormat``, ``IsaLevel``,
``WaitOutcome``); Python passes their members, never integers. ``native_dtype`` and ``native_format``
are the one place torch dtypes become members.
"""
from __future__ import annotations

import functools
import importlib.util
import struct
from types import ModuleType
from typing import Any, Optional

import torch

from . import env

__all__ = ["native", "build_info", "require", "cpu_threads", "NATIVE_DTYPES", "native_dtype", "native_format",
           "cuda_module", "cuda_archs", "fatbin_archs"]

# torch dtype -> name of its member of moe_comm._C.DType (csrc/common/codes.h): the float rows the kernels take
_DTYPES = {torch.float32: "FLOAT32", torch.bfloat16: "BFLOAT16", torch.float16: "FLOAT16"}
# dtype of the codes -> name of its member of moe_comm._C.QuantFormat
_FORMATS = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2", torch.int8: "INT8"}

#: The float dtypes the CPU kernels read and write, for checks that need not load ``_C``.
NATIVE_DTYPES = tuple(_DTYPES)


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ModuleType | None, str]:
    try:
        from .. import _C  # type: ignore[attr-defined]
    except ImportError as exc:  # reported by require() with the import error
        return None, str(exc)
    return _C, ""


def build_info() -> dict[str, Any]:
    """What this build contains: ``{"cpu": bool, "cuda": bool, "ascend": bool, "bang": bool, ...}``.

    ``"cuda"``: whether ``moe_comm._cuda`` (the device build of ``csrc/cuda``, for the ``cuda`` backend)
    was built and imports; ``"cuda_archs"``: the GPU code it holds (``"sm_90"``: a cubin for sm_90,
    ``"compute_100"``: PTX for compute_100), ``"cuda_error"`` why it failed to import, if it did;
    ``"cuda_host"``: whether ``moe_comm._cuda_host`` (the kernels' host build) was built;
    ``"cuda_nvshmem"``: whether ``moe_comm._cuda_nvshmem`` (the kernels on NVSHMEM) was built (not
    imported here: that loads NVSHMEM's host library; ``moe_comm.backends.cuda.nvshmem_lib.available()``
    says whether it loads). ``"cuda_not_built"`` and ``"cuda_nvshmem_not_built"``, present only for a
    module that is missing: why, as CMake decided when it configured the build (``"MOE_COMM_CUDA=OFF"``,
    ``"nvcc not found (MOE_COMM_CUDA=AUTO): ..."``, ``"NVSHMEM not found: ..."``; docs/install.md says
    what to change). Everything else comes from ``moe_comm._C``: all False (plus ``"error"``) when that
    extension is missing.
    """
    module, error = _load()
    if module is None:
        info: dict[str, Any] = {"cpu": False, "cuda": False, "ascend": False, "bang": False, "error": error}
    else:
        info = dict(module.build_info())
    # CMake's reasons, recorded in _C: "" for a module it built
    reasons = {"cuda": info.pop("cuda_not_built", None), "cuda_nvshmem": info.pop("cuda_nvshmem_not_built", None)}
    cuda, cuda_error = cuda_module()
    cuda_file = importlib.util.find_spec("moe_comm._cuda") is not None
    info["cuda"] = cuda is not None
    info["cuda_archs"] = cuda_archs()
    if cuda_error and cuda_file:
        info["cuda_error"] = cuda_error
    info["cuda_host"] = importlib.util.find_spec("moe_comm._cuda_host") is not None
    info["cuda_nvshmem"] = importlib.util.find_spec("moe_comm._cuda_nvshmem") is not None
    for part, present in (("cuda", cuda_file), ("cuda_nvshmem", info["cuda_nvshmem"])):
        if not present:
            info[f"{part}_not_built"] = _why_not_built(f"moe_comm._{part}", reasons[part], error)
    return info


def _why_not_built(name: str, reason: Optional[str], c_error: str) -> str:
    """CMake's reason for leaving ``name`` out, or what can be said without one."""
    if reason:
        return reason
    if c_error:
        return f"unknown: moe_comm._C, which records why CMake left {name} out, failed to import ({c_error})"
    if reason is None:
        return (f"unknown: this moe_comm._C predates the build's reasons; rebuild (pip install .) to see why "
                f"{name} is missing")
    return f"{name} is not installed, though the build that made moe_comm._C configured it (files removed?)"


@functools.lru_cache(maxsize=None)
def cuda_module() -> tuple[ModuleType | None, str]:
    """(``moe_comm._cuda``, "") when the device build of csrc/cuda imports, else (None, why). Importing
    it makes no CUDA call (static cudart), so this works on a machine without a GPU or a driver."""
    try:
        from .. import _cuda  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, str(exc)
    return _cuda, ""


@functools.lru_cache(maxsize=None)
def cuda_archs() -> list[str]:
    """The GPU code in ``moe_comm._cuda``'s fat binary, read from the file (no CUDA call):
    ``"sm_XY"`` per cubin, ``"compute_XY"`` per PTX, sorted; [] when it is not built or unreadable."""
    spec = importlib.util.find_spec("moe_comm._cuda")
    if spec is None or not spec.origin:
        return []
    try:
        with open(spec.origin, "rb") as f:
            return fatbin_archs(f.read())
    except (OSError, ValueError, struct.error):
        return []


_FATBIN_MAGIC = 0xBA55ED50
_FATBIN_KINDS = {1: "compute", 2: "sm"}  # an entry's kind: PTX, ELF (cubin)


def fatbin_archs(elf: bytes) -> list[str]:
    """The architectures of the CUDA fat binaries in the ``.nv_fatbin`` section of the ELF64 file
    ``elf`` (little-endian): ``"sm_90"`` for an sm_90 cubin, ``"compute_100"`` for compute_100 PTX.

    A fat binary is a 16-byte header (magic 0xBA55ED50, u16 version, u16 header size, u64 size of
    the entries) and entries, each a header (u16 kind at 0, u32 header size at 4, u64 payload size
    at 8, u32 architecture at 28) and its payload. ValueError when the file is not ELF64 or has no
    such section."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("fatbin_archs: not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    blob = None
    for i in range(shnum):
        name, offset, size = section(i)
        end = elf.index(b"\0", names_at + name)
        if elf[names_at + name:end] == b".nv_fatbin":
            blob = elf[offset:offset + size]
    if blob is None:
        raise ValueError("fatbin_archs: no .nv_fatbin section")
    found: set[tuple[str, int]] = set()
    pos = 0
    while pos + 16 <= len(blob):
        magic, _, header, size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != _FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        entry, end = pos + header, pos + header + size
        while entry + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", blob, entry)
            arch, = struct.unpack_from("<I", blob, entry + 28)
            if kind in _FATBIN_KINDS:
                found.add((_FATBIN_KINDS[kind], arch))
            if entry_header == 0:
                break
            entry += entry_header + payload
        pos = max(end, pos + 8)
    return [f"{kind}_{arch}" for kind, arch in sorted(found, key=lambda ka: (ka[1], ka[0] != "sm"))]


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


def native_dtype(dtype: torch.dtype, module: Optional[ModuleType] = None) -> Any:
    """The ``DType`` member of ``dtype``, one of NATIVE_DTYPES, bound by ``module`` (default ``moe_comm._C``;
    the CUDA modules bind the same table); ValueError for any other."""
    if dtype not in _DTYPES:
        raise ValueError(f"native_dtype: the kernels take {list(NATIVE_DTYPES)}, got {dtype}")
    return getattr((module or native()).DType, _DTYPES[dtype])


def native_format(dtype: torch.dtype) -> Any:
    """The ``moe_comm._C.QuantFormat`` member whose codes have ``dtype`` (float8_e4m3fn, float8_e5m2 or int8);
    ValueError for any other."""
    if dtype not in _FORMATS:
        raise ValueError(f"native_format: the CPU kernels write codes of {list(_FORMATS)}, got {dtype}")
    return getattr(native().QuantFormat, _FORMATS[dtype])
