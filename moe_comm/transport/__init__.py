"""Transports: one class per mechanism for moving bytes between ranks, chosen by name.

``Buffer(..., transport="auto")`` picks by the group's backend: gloo (CPU tensors) uses ``shm``
(shared memory between the ranks of a host, ``collective`` between hosts), every other backend
``collective``. The environment variable ``MOE_COMM_TRANSPORT`` overrides the choice. The ``cuda``
and vendor transports arrive later and register here.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import env
from .base import Exchange, Pending, Transport
from .collective import CollectiveTransport
from .shm import ShmTransport

__all__ = ["Exchange", "Pending", "Transport", "CollectiveTransport", "ShmTransport", "available", "resolve",
           "create"]

_TRANSPORTS: dict[str, type[Transport]] = {CollectiveTransport.name: CollectiveTransport,
                                           ShmTransport.name: ShmTransport}


def available() -> list[str]:
    """Names accepted by ``Buffer(transport=...)`` besides ``"auto"``."""
    return sorted(_TRANSPORTS)


def resolve(requested: str, group: dist.ProcessGroup) -> str:
    """The transport name for ``requested`` (``"auto"`` or a name) on ``group``.

    ``MOE_COMM_TRANSPORT`` replaces ``"auto"``; an explicit name wins over the environment.
    """
    name = requested
    if name == "auto":
        name = env.transport() or "auto"
    if name == "auto":
        # gloo carries CPU tensors; every other backend (nccl, hccl, cncl, mpi) implements all_to_all_single.
        return ShmTransport.name if str(dist.get_backend(group)) == "gloo" else CollectiveTransport.name
    if name not in _TRANSPORTS:
        raise ValueError(f"Buffer: transport must be 'auto' or one of {available()}, got {name!r}"
                         + (" (from MOE_COMM_TRANSPORT)" if requested == "auto" else ""))
    return name


def create(name: str, group: dist.ProcessGroup, timeout_s: float, buffer_bytes: int = 0) -> Transport:
    """Builds transport ``name`` (as returned by ``resolve``) for ``group``. Collective.
    ``buffer_bytes``: the size of this rank's communication buffer (both slots), for transports that
    preallocate one."""
    return _TRANSPORTS[name](group, timeout_s, buffer_bytes)
