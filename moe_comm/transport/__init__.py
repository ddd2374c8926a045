"""Transports: one class per mechanism for moving bytes between ranks, chosen by name.

``Buffer(..., transport="auto")`` picks by the group's backend and the environment variable
``MOE_COMM_TRANSPORT`` overrides the choice. Today every backend and device uses ``collective``;
the ``shm``, ``cuda`` and vendor transports arrive later and register here.
"""
from __future__ import annotations

import torch.distributed as dist

from .. import env
from .base import Pending, Transport
from .collective import CollectiveTransport

__all__ = ["Pending", "Transport", "CollectiveTransport", "available", "resolve", "create"]

_TRANSPORTS: dict[str, type[Transport]] = {CollectiveTransport.name: CollectiveTransport}


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
        # Every backend (gloo, nccl, hccl, cncl, mpi) implements all_to_all_single.
        return CollectiveTransport.name
    if name not in _TRANSPORTS:
        raise ValueError(f"Buffer: transport must be 'auto' or one of {available()}, got {name!r}"
                         + (" (from MOE_COMM_TRANSPORT)" if requested == "auto" else ""))
    return name


def create(name: str, group: dist.ProcessGroup, timeout_s: float) -> Transport:
    """Builds transport ``name`` (as returned by ``resolve``) for ``group``. Collective."""
    return _TRANSPORTS[name](group, timeout_s)
