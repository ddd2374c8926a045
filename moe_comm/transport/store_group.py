"""A gloo group built from the rendezvous store alone, for one membership epoch of an elastic Buffer.

Why: a ``torch.distributed`` group has a fixed set of processes. Once a rank has died, its pairs in
every group are broken, and a process started to replace it cannot enter them: building a group
through ``torch.distributed.new_group`` needs every rank of the default group, the dead one included.
The rendezvous store outlives ranks (torchrun's agent, or any long-lived host of a ``TCPStore``), so
the members of a new epoch (the survivors and the replacements) build a fresh gloo group from it, under
a prefix of their own, as the collective transport already builds its metadata channel. The transports
take a ``StoreGroup`` where they take a group, and call its backend directly (it is not registered with
``torch.distributed``, so ``dist.*`` functions cannot name it).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist

__all__ = ["StoreGroup", "gloo_backend"]


@dataclass
class StoreGroup:
    """Rank ``rank`` of ``size`` in a gloo group connected through ``store`` under ``scope`` (unique to the
    epoch); ``global_ranks``: each rank's place in the launcher's world (how the epoch-0 group placed it:
    emulated nodes count world ranks), None when that group was not the whole world."""

    store: dist.Store
    scope: str
    rank: int
    size: int
    global_ranks: Optional[Sequence[int]]
    backend: dist.ProcessGroup

    @staticmethod
    def connect(store: dist.Store, scope: str, rank: int, size: int, timeout_s: float,
                global_ranks: Optional[Sequence[int]]) -> "StoreGroup":
        """Connects to the other ``size - 1`` ranks that call it with the same ``scope``; blocks until
        all have (gloo raises at ``timeout_s``). Every rank of the epoch must call it."""
        backend = gloo_backend(dist.PrefixStore(f"{scope}/gloo", store), rank, size, timeout_s)
        return StoreGroup(store, scope, rank, size, None if global_ranks is None else list(global_ranks), backend)


def gloo_backend(store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks connected through ``store``, connected now whatever
    ``TORCH_GLOO_LAZY_INIT`` says (why: a replacement process sets it so that its world group does not try
    to reach the survivors, and a lazily connecting rank cannot pair with eagerly connecting ones), on the
    interfaces ``GLOO_SOCKET_IFNAME`` names, as torch's own gloo groups."""
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=False) for name in interfaces] \
        or [dist.ProcessGroupGloo.create_default_device(lazy_init=False)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)
