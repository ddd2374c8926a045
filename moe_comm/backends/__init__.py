"""Backends: the implementations of ``Buffer``'s operations, chosen by name (``base.Backend`` is the
interface).

``portable`` (``backends/portable/``) runs on every device over a ``moe_comm.transport`` and is the
reference the others must match bit for bit. ``cuda_host`` (``backends/cuda/``) runs the CUDA
kernels' host build on CPU ranks of one host, so the kernels' protocol runs under every CPU test. Native backends hold device kernels and initiate
communication from the device: ``cuda`` (``backends/cuda/device_backend.py``: the device build
``moe_comm._cuda`` of ``csrc/cuda``, CUDA IPC between the GPUs of one node), ``ascend`` (HCCL, MC2) and
``cambricon`` (CNCL). Each is a folder beside ``portable/`` and registers here; until one can run,
asking for it says why it is not available.

``Buffer(backend="auto")`` (the default; ``MOE_COMM_BACKEND`` may name one) takes the native backend
of the group's device when it is available, else ``portable``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..core import env
from ..core.errors import BackendUnavailableError
from ..core.native import cuda_module
from .base import Backend

__all__ = ["Backend", "Choice", "CUDA_HOST", "KNOWN", "PORTABLE", "available", "unavailable_reason", "choose", "create", "load",
           "fp8_dispatch"]


@dataclass(frozen=True)
class _Native:
    """A native backend: the device type it serves and what it is built from."""

    device_type: str
    kernels: str


PORTABLE = "portable"
#: the host build of the CUDA kernels (moe_comm._cuda_host), on CPU tensors
CUDA_HOST = "cuda_host"
# The native backends and what each needs (their classes register in _built()).
_NATIVE = {"cuda": _Native("cuda", "csrc/cuda (moe_comm._cuda, CUDA IPC)"),
           "ascend": _Native("npu", "torch_npu's HCCL and MC2 operators (backends/ascend)"),
           "cambricon": _Native("mlu", "torch_mlu's CNCL and torch_mlu_ops (backends/cambricon)")}
#: every backend name ``Buffer(backend=...)`` knows, built or not
KNOWN = (PORTABLE, CUDA_HOST) + tuple(_NATIVE)
# torch.distributed backend of a group -> the device type its tensors live on, where the group does not
# say (``dist.get_backend_config`` names the devices: "npu:hccl" is Ascend, "hpu:hccl" Intel Gaudi)
_GROUP_DEVICE = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "hccl": "npu", "cncl": "mlu"}


def _built() -> dict[str, type[Backend]]:
    """The backend classes this moe_comm has. Imported when a Buffer is built: the modes import
    ``moe_comm.protocol.handle``, which imports the portable backend's wire helpers. The vendor backends import
    no vendor module until one is built."""
    from .ascend.backend import AscendBackend
    from .cambricon.backend import CambriconBackend
    from .portable.backend import PortableBackend
    built: dict[str, type[Backend]] = {PortableBackend.name: PortableBackend, AscendBackend.name: AscendBackend,
                                       CambriconBackend.name: CambriconBackend}
    if importlib.util.find_spec("moe_comm._cuda_host") is not None:
        from .cuda.backend import CudaHostBackend
        built[CudaHostBackend.name] = CudaHostBackend
    if cuda_module()[0] is not None:
        from .cuda.device_backend import CudaBackend
        built[CudaBackend.name] = CudaBackend
    return built


def _cuda_reason() -> Optional[str]:
    """Why the ``cuda`` backend cannot run here: its build (moe_comm._cuda), torch's CUDA, a device."""
    module, error = cuda_module()
    if module is None:
        if importlib.util.find_spec("moe_comm._cuda") is None:
            return ("moe_comm._cuda (the device build of csrc/cuda) is not built: build with nvcc on PATH "
                    "(MOE_COMM_CUDA=AUTO|ON)")
        return f"moe_comm._cuda (the device build of csrc/cuda) failed to import: {error}"
    if not torch.cuda.is_available():
        built_without = "" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)"
        return f"torch.cuda.is_available() is False{built_without}"
    if module.device_count() <= 0:
        return "moe_comm._cuda.device_count() is 0 (moe_comm._cuda sees no CUDA device)"
    return None


def unavailable_reason(name: str) -> Optional[str]:
    """Why backend ``name`` cannot run in this process, or None when it can."""
    if name == PORTABLE:
        return None
    if name == CUDA_HOST:
        return None if name in _built() else "moe_comm._cuda_host (the host build of csrc/cuda) is not built"
    if name == "cuda":
        return _cuda_reason()
    from .ascend.backend import ascend_reason
    from .cambricon.backend import cambricon_reason
    return ascend_reason() if name == "ascend" else cambricon_reason()


def available() -> list[str]:
    """The backends that can run here."""
    return [name for name in KNOWN if unavailable_reason(name) is None]


@dataclass(frozen=True)
class Choice:
    """The backend a Buffer uses, and why (for messages)."""

    name: str
    why: str

    def __str__(self) -> str:
        return f"backend {self.name!r} ({self.why})"


def _group_device(group: Optional[dist.ProcessGroup], comm: Any) -> tuple[str, str]:
    """(device type, what it was read from) of the ranks' group: the first accelerator its backend
    config names ("cpu:gloo,npu:hccl" -> npu; "hpu:hccl", Intel Gaudi's HCCL, -> hpu), else cpu."""
    if comm is not None:
        return "cpu", "an mpi4py communicator"
    backend = str(dist.get_backend(group))
    try:
        pairs = [part.split(":") for part in str(dist.get_backend_config(group)).split(",")]
        # gloo lists "cuda:gloo" too: a device counts only under its own collective library
        devices = [device for device, name in pairs if name not in ("gloo", "mpi")]
    except (RuntimeError, ValueError):  # no config to read: the backend names decide
        devices = [_GROUP_DEVICE.get(part.split(":")[-1], "cpu") for part in backend.split(",")]
    return next((d for d in devices if d != "cpu"), "cpu"), f"a {backend} group"


def choose(requested: str, group: Optional[dist.ProcessGroup], comm: Any = None) -> Choice:
    """The backend for ``requested`` (``"auto"`` or a name from ``KNOWN``) on ``group`` / ``comm``.

    ``MOE_COMM_BACKEND`` replaces ``"auto"``; an explicit name wins over the environment. Raises
    ValueError for an unknown name and BackendUnavailableError, naming the reason and the available
    backends, for a known one that cannot run here.
    """
    name, source = requested, "backend="
    if name == "auto" and env.backend():
        name, source = env.backend(), "MOE_COMM_BACKEND="
    if name != "auto" and name not in KNOWN:
        raise ValueError(f"Buffer: backend must be 'auto' or one of {list(KNOWN)}, got {source}{name!r}")
    if name != "auto":
        reason = unavailable_reason(name)
        if reason is not None:
            raise BackendUnavailableError(f"Buffer: {source}{name!r} is not available: {reason}; available here: "
                                          f"{available()}")
        return Choice(name, f"{source}{name!r}")
    device, seen = _group_device(group, comm)
    native = next((n for n, spec in _NATIVE.items() if spec.device_type == device), None)
    if native is None:
        return Choice(PORTABLE, f"auto: {seen} holds {device} tensors, which no native backend serves")
    reason = unavailable_reason(native)
    if reason is None:
        return Choice(native, f"auto: {seen} holds {device} tensors")
    return Choice(PORTABLE, f"auto: {seen} holds {device} tensors; the {native} backend is not available "
                                        f"({reason})")


def load() -> None:
    """Imports the backend classes now, which building the first Buffer of a process otherwise does (a
    replacement rank does it before it says it is ready, so that its survivors do not wait for it)."""
    _built()


def create(choice: Choice, **kwargs: Any) -> Backend:
    """Builds the chosen backend (collective); ``kwargs`` are its constructor's arguments."""
    factory: Callable[..., Backend] = _built()[choice.name]
    return factory(**kwargs)


def fp8_dispatch() -> bool:
    """Whether a backend that can run here dispatches FP8 ``(x, scales)`` tuples (every one does)."""
    return any(_built()[name].fp8_dispatch() for name in available())
