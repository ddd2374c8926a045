"""Membership epochs of an elastic Buffer: a replacement for a dead rank joins, the survivors admit it.

An epoch is one membership of the Buffer's ranks and the backend (transport, call numbers, buffer
halves) built for it. Epoch 0 runs on the caller's group. A rank that dies is masked in the epoch it
dies in (``enable_shrink``, ``protocol/shrink.py``). A process started in its place builds its Buffer
with ``rejoin=True``: it announces itself in the rendezvous store and waits. The survivors find it in a
dispatch's handshake, all in the same call (``CallAgreement.admit``), and at their next low-latency
dispatch every member builds the next epoch from the store (``StoreGroup``, then a fresh backend, whose
call numbers and halves start where every member's start: at the beginning), and commits it only if
every member built it (``transport/admission.py``); otherwise everyone stays where it was. The
``Buffer`` object, and what its caller built on it, stay the same; only its ``runtime`` changes.
"""
from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch.distributed as dist

from ..backends.base import Backend
from ..core.errors import CommTimeoutError
from ..transport.admission import COMMIT, Admissions
from ..transport.base import host_id
from ..transport.collective import STORE_WAIT_S, bounded, default_store
from ..transport.store_group import StoreGroup

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = ["Membership"]

#: elastic Buffers made on each group name by this process: the n-th on one process pairs with the n-th on
#: every other, a replacement's included (it runs the same program)
_MADE: collections.Counter = collections.Counter()


class Membership:
    """The epochs of one elastic Buffer on this rank."""

    def __init__(self, group: dist.ProcessGroup, store: dist.Store, timeout_s: float) -> None:
        name = getattr(group, "group_name", "default")
        _MADE[name] += 1
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        whole = self.num_ranks == dist.get_world_size()  # emulated nodes count world ranks (as the transports)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.num_ranks)] if whole else None
        self.admissions = Admissions(store, f"moe_comm/elastic/{name}/{_MADE[name]}", self.rank, self.num_ranks)
        self.timeout_s = timeout_s
        self.epoch = 0
        #: per epoch tried: its number, the ranks admitted, the outcome and the seconds it took
        self.history: list[dict] = []

    @staticmethod
    def of(group: dist.ProcessGroup, transport_name: Optional[str], timeout_s: float) -> Optional["Membership"]:
        """The membership of a shrinking Buffer on ``group`` whose ranks can be replaced, or None: the
        rendezvous store is needed, and MPI cannot admit a process (``Buffer`` says so for ``rejoin``)."""
        store = default_store()
        if store is None or transport_name == "mpi" or group is None:
            return None
        return Membership(group, store, timeout_s)

    def watch(self, runtime: Backend) -> Backend:
        """Wires ``runtime``'s handshakes to this membership's announcements; returns it."""
        runtime.watch_rejoins(lambda masked: frozenset(self.admissions.ready(masked)))
        return runtime

    # ------------------------------------------------------------------ the replacement
    def join(self, build: Callable[[StoreGroup], Backend]) -> Backend:
        """Announces this rank, waits (the deadline) for the survivors' invitation, and builds the epoch
        it was invited to with them. Returns the committed backend; raises CommTimeoutError when nobody
        invited it, RuntimeError when the epoch was aborted."""
        op = "Buffer(rejoin=True)"
        start = time.monotonic()
        token = self.admissions.announce(host_id())
        # the survivors look at their next dispatch, which may itself wait one deadline (a rank found dead, an
        # admission that failed) after a step that did
        wait_s = 2 * self.timeout_s + STORE_WAIT_S
        epoch = self.admissions.invitation(token, start + wait_s)
        if epoch is None:
            self.admissions.withdraw({self.rank: token})
            raise CommTimeoutError(op, self.rank, wait_s, None,
                                   "no survivor invited this rank: the survivors admit a replacement at a "
                                   "low-latency dispatch of an enable_shrink=True Buffer, once every masked rank "
                                   "has one ready")
        runtime, outcome = self._enter(epoch, build, ())
        self._record(epoch, frozenset({self.rank}), outcome, start)
        if runtime is None:
            raise RuntimeError(f"{op}: rank {self.rank}: epoch {epoch} was aborted ({outcome}); start this process "
                               f"again to retry")
        return runtime

    # ------------------------------------------------------------------ the survivors
    def admit(self, joiners: frozenset[int], build: Callable[[StoreGroup], Backend]) -> Optional[Backend]:
        """Builds the next epoch with ``joiners`` (decided in one handshake on every survivor). Returns the
        committed backend, or None when the epoch was aborted (the caller keeps its backend; the
        joiners' announcements are withdrawn, so they are not tried again until they announce anew)."""
        start = time.monotonic()
        epoch = self.epoch + 1
        tokens = self.admissions.ready(joiners)
        self.admissions.invite(tokens, epoch)
        runtime, outcome = self._enter(epoch, build, [r for r in range(self.num_ranks) if r not in joiners])
        self._record(epoch, joiners, outcome, start)
        if runtime is None:
            self.admissions.withdraw(tokens)
        return runtime

    # ------------------------------------------------------------------ both
    def _enter(self, epoch: int, build: Callable[[StoreGroup], Backend],
               survivors: Sequence[int]) -> tuple[Optional[Backend], str]:
        """Builds this rank's side of ``epoch`` and runs the commit: (the backend or None, the outcome)."""
        self.epoch = epoch  # an aborted epoch's number is not used again: its keys hold its decision
        # NOTES: gloo retries a refused connection (a member that died after it published its address)
        # several times over, each with the whole timeout: the connection is bounded here instead.
        deadline = time.monotonic() + self.timeout_s + 2 * STORE_WAIT_S
        runtime, why = None, ""
        try:
            group = bounded(lambda: StoreGroup.connect(self.admissions.store, self.admissions.epoch_scope(epoch),
                                                       self.rank, self.num_ranks, self.timeout_s, self.global_ranks),
                            self.timeout_s + STORE_WAIT_S, f"epoch {epoch}: connecting its group")
            runtime = self.watch(build(group))
        except Exception as exc:  # a member died or never came: every member aborts, below
            why = f"{type(exc).__name__}: {exc}"
        decision = self.admissions.decide(epoch, runtime is not None, deadline, survivors)
        if decision == COMMIT:
            return runtime, decision
        if runtime is not None:
            runtime.destroy()
        return None, why or f"another member of epoch {epoch} failed to build it, or the deadline passed"

    def _record(self, epoch: int, joiners: frozenset[int], outcome: str, start: float) -> None:
        self.history.append({"epoch": epoch, "ranks": sorted(joiners), "outcome": outcome,
                             "seconds": time.monotonic() - start})
