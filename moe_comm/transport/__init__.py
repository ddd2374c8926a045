"""Transports: one class per mechanism for moving bytes between ranks, chosen by name.

``Buffer(..., transport="auto")`` picks by the group's backend: gloo (CPU tensors) uses ``shm``
(shared memory between the ranks of a host, ``collective`` between hosts), mpi uses ``mpi`` (MPI's
own all-to-all-v through mpi4py), every other backend ``collective``; an mpi4py communicator
(``Buffer(comm=...)``) always uses ``mpi``. The environment variable ``MOE_COMM_TRANSPORT``
overrides the choice for groups. The ``cuda`` and vendor transports arrive later and register here.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ..core import env
from .base import Exchange, Pending, Transport
from .collective import CollectiveTransport
from .mpi import MpiTransport
from .shm import ShmTransport

__all__ = ["Exchange", "Pending", "Transport", "CollectiveTransport", "MpiTransport", "ShmTransport", "available",
           "auto", "resolve", "create"]

_TRANSPORTS: dict[str, type[Transport]] = {CollectiveTransport.name: CollectiveTransport,
                                           MpiTransport.name: MpiTransport, ShmTransport.name: ShmTransport}


def available() -> list[str]:
    """Names accepted by ``Buffer(transport=...)`` besides ``"auto"``."""
    return sorted(_TRANSPORTS)


def auto(backend: str) -> str:
    """The transport ``"auto"`` means on a group of torch.distributed backend ``backend``."""
    if backend == "gloo":  # CPU tensors: shared memory within a host
        return ShmTransport.name
    if backend == "mpi":  # MPI's own all-to-all-v, without torch's MPI backend in between
        return MpiTransport.name
    return CollectiveTransport.name  # nccl, hccl, cncl, ... implement all_to_all_single


def resolve(requested: str, group: Optional[dist.ProcessGroup], comm: Any = None) -> str:
    """The transport name for ``requested`` (``"auto"`` or a name) on ``group``, or on the mpi4py
    communicator ``comm`` when one is given (then only ``mpi`` can carry it).

    ``MOE_COMM_TRANSPORT`` replaces ``"auto"``; an explicit name wins over the environment.
    """
    name = requested
    if name == "auto":
        name = env.transport() or "auto"
    source = " (from MOE_COMM_TRANSPORT)" if requested == "auto" and name != "auto" else ""
    if name == "auto":
        return MpiTransport.name if comm is not None else auto(str(dist.get_backend(group)))
    if name not in _TRANSPORTS:
        raise ValueError(f"Buffer: transport must be 'auto' or one of {available()}, got {name!r}{source}")
    if comm is not None and name != MpiTransport.name:
        raise ValueError(f"Buffer: transport must be 'auto' or 'mpi' when comm (an mpi4py communicator) is "
                         f"given, got {name!r}{source}")
    return name


def create(name: str, group: Optional[dist.ProcessGroup], timeout_s: float, buffer_bytes: int = 0,
           comm: Any = None) -> Transport:
    """Builds transport ``name`` (as returned by ``resolve``) for ``group``, or for ``comm`` (mpi
    only). Collective. ``buffer_bytes``: the size of this rank's communication buffer (both slots),
    for transports that preallocate one."""
    return _TRANSPORTS[name](comm if comm is not None else group, timeout_s, buffer_bytes)
