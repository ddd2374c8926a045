"""A gloo group built from the rendezvous store alone, for one membership epoch of an elastic Buffer.

Why: a ``torch.distributed`` group has a fixed set of processes. Once a rank has died, its pairs in
every group are broken, and a process started to replace it cannot enter them: building a group
through ``torch.distributed.new_group`` needs every rank of the default group, the dead one included.
The rendezvous store outlives ranks (torchrun's agent, or any long-lived host of a ``TCPStore``), so
the members of a new epoch (the survivors and the replacements) build a fresh gloo group from it, under
a prefix of their own, as the collective transport already builds its metadata channel. The transports
take a ``StoreGroup`` where they take a group, and call its backend directly (it is not registered with
``torch.distributed``, so ``dist.*`` functions cannot name it).

An epoch may have **absent** ranks: a masked rank whose replacement has not come yet, or a reserved slot of a
job that started short of ranks. Their numbers are kept, but no process holds them: the gloo group holds the
members only (``place`` maps a rank to its place there), nothing is ever sent to an absent rank (every member
masks it), and the transports' own collectives skip them. Why not a group of every rank with gloo's lazy
pairs: a lazy pair connects inside the caller's first send, which waits there, outside every deadline of
ours, for a member that died before it connected.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch.distributed as dist

__all__ = ["StoreGroup", "gloo_backend", "members_places"]


@dataclass
class StoreGroup:
    """Rank ``rank`` of ``size`` in a gloo group connected through ``store`` under ``scope`` (unique to the
    epoch); ``global_ranks``: each rank's place in the launcher's world (how the epoch-0 group placed it:
    emulated nodes count world ranks), None when that group was not the whole world; ``absent``: the ranks no
    process holds in this epoch (see the module docstring); ``backend``: the gloo group of the others."""

    store: dist.Store
    scope: str
    rank: int
    size: int
    global_ranks: Optional[Sequence[int]]
    backend: dist.ProcessGroup
    absent: frozenset[int] = field(default_factory=frozenset)

    @staticmethod
    def connect(store: dist.Store, scope: str, rank: int, size: int, timeout_s: float,
                global_ranks: Optional[Sequence[int]], absent: frozenset[int] = frozenset()) -> "StoreGroup":
        """Connects to the other ranks that call it with the same ``scope`` (every rank of ``size`` but
        ``absent``, and the same ``absent`` on each); blocks until all have (gloo raises at ``timeout_s``)."""
        places = members_places(size, absent)
        backend = gloo_backend(dist.PrefixStore(f"{scope}/gloo", store), places[rank], len(places), timeout_s)
        return StoreGroup(store, scope, rank, size, None if global_ranks is None else list(global_ranks), backend,
                          frozenset(absent))


def members_places(size: int, absent: frozenset[int]) -> dict[int, int]:
    """Each rank of ``size`` but ``absent`` -> its place in a group of those ranks (in rank order)."""
    return {r: i for i, r in enumerate(r for r in range(size) if r not in absent)}


def gloo_backend(store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks connected through ``store``, connected now whatever
    ``TORCH_GLOO_LAZY_INIT`` says (why: a replacement process sets it so that its world group does not try
    to reach the survivors, and a lazily connecting rank cannot pair with eagerly connecting ones), on the
    interfaces ``GLOO_SOCKET_IFNAME`` names, as torch's own gloo groups. Through a client
    of its own (``Store.clone``, torch 2.5 on): a TCP store client serves one request at a time, so gloo
    waiting there for a member that died (up to ``timeout_s``, at each pair a lazy group connects) would hold
    every other store request of this process, the shrink rounds' and the admissions', as long. That client
    waits at most ``timeout_s`` (the store's own timeout is the launcher's, e.g. torchrun's 5 minutes)."""
    clone = getattr(store, "clone", None)
    if clone is not None:
        store = clone()
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=name, lazy_init=False) for name in interfaces] \
        or [dist.ProcessGroupGloo.create_default_device(lazy_init=False)]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)
