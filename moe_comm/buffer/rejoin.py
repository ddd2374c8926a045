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

An epoch need not hold every rank: the survivors admit whichever replacements are ready, and the masked
ranks that have none stay **absent** from the new epoch (masked from its start, ``StoreGroup``). A job can
also start short of ranks (``min_ranks``, Mooncake's reserved slots): the ranks that came start epoch 1
from the store with the others absent, and a rank that starts later fills its slot as a replacement does.
"""
from __future__ import annotations

import collections
import time
import weakref
from typing import Callable, Iterable, Optional, Sequence

import torch.distributed as dist

from ..backends.base import Backend
from ..core.errors import CommTimeoutError, bad_argument
from ..transport.admission import ABORT, COMMIT, START_EPOCH, Admissions
from ..transport.base import host_id
from ..transport.collective import STORE_WAIT_S, bounded, default_store, process_alive
from ..transport.store_group import StoreGroup

__all__ = ["Membership", "REJOINABLE", "JOIN_TRIES"]

#: how many epochs a replacement tries to join before it gives up (each aborted try: a member died in it; a
#: loss of two survivors during one admission took two, measured)
JOIN_TRIES = 5

#: the backends whose buffers admit replacements (an epoch's group is gloo; the cuda backend's rejoin path
#: is the cuda_host one, never run on a GPU)
REJOINABLE = ("portable", "cuda_host")

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
        self.epoch = 0  # the last epoch tried
        self.parts: dict[str, float] = {}  # (see _enter)
        #: when this replacement last said it was ready (``time.time()``); None on a survivor
        self.announced_at: Optional[float] = None
        self.committed = 0  # the epoch this rank runs in
        #: per epoch tried: its number, the ranks admitted (or, ``start``, the ranks the job started with), the
        #: outcome and the seconds it took
        self.history: list[dict] = []
        #: the handles (their first tensor) of this epoch's last two dispatches, and of earlier epochs' (with
        #: their epoch): a handle of an earlier epoch names rows of a backend that is gone
        self._handles: collections.deque = collections.deque(maxlen=2)
        self._retired: list[tuple[weakref.ref, int]] = []

    @staticmethod
    def of(group: dist.ProcessGroup, backend_name: str, transport_name: Optional[str],
           timeout_s: float) -> Optional["Membership"]:
        """The membership of a shrinking Buffer on ``group`` whose ranks can be replaced, or None where they
        cannot (``Buffer`` says why to a replacement): the rendezvous store is needed, MPI cannot admit a
        process, and an epoch's group is gloo, which the portable and cuda_host backends run on."""
        store = default_store()
        if store is None or group is None or transport_name == "mpi" or backend_name not in REJOINABLE:
            return None
        return Membership(group, store, timeout_s)

    def watch(self, runtime: Backend) -> Backend:
        """Wires ``runtime``'s handshakes to this membership's announcements; returns it."""
        runtime.watch_rejoins(self._ready)
        return runtime

    def _ready(self, masked: frozenset[int]) -> frozenset[int]:
        """Which of ``masked`` have a replacement ready, as far as the store answers within a store wait: a store
        whose host is stopped never answers, and the call it is asked in must not wait for it (another rank's
        note may still flag the replacement: the ranks admit the union)."""
        try:
            return frozenset(bounded(lambda: self.admissions.ready(masked), STORE_WAIT_S, "looking for replacements"))
        except (TimeoutError, RuntimeError, ValueError):
            return frozenset()

    # ------------------------------------------------------------------ the replacement
    def join(self, build: Callable[[StoreGroup], Backend]) -> Backend:
        """Announces this rank, waits for the survivors' invitation, and builds the epoch it was invited to
        with them; an aborted epoch (a member died in it) is announced again, up to ``JOIN_TRIES`` times.
        Returns the committed backend; raises CommTimeoutError when nobody invited it, RuntimeError when its
        tries were all aborted."""
        op = "Buffer(rejoin=True)"
        # the survivors look at their next dispatch, which may itself wait one deadline (a rank found dead, an
        # admission that failed) after a step that did
        wait_s = 2 * self.timeout_s + STORE_WAIT_S
        outcomes = []
        for _ in range(JOIN_TRIES):
            start = time.monotonic()
            token = self.admissions.announce(host_id())
            self.announced_at = time.time()
            invited = self.admissions.invitation(token, start + wait_s)
            if invited is None:
                self.admissions.withdraw({self.rank: token})
                raise CommTimeoutError(op, self.rank, wait_s, None,
                                       "no survivor invited this rank: the survivors admit a replacement at a "
                                       "low-latency dispatch of an enable_shrink=True Buffer"
                                       + (f" (earlier tries: {'; '.join(outcomes)})" if outcomes else ""))
            epoch, absent = invited
            runtime, outcome = self._enter(epoch, build, (), lambda: (), absent)
            self._record(epoch, frozenset({self.rank}), outcome, start)
            if runtime is not None:
                return runtime
            outcomes.append(f"epoch {epoch} aborted: {outcome}")
        raise RuntimeError(f"{op}: rank {self.rank}: every try to join was aborted ({'; '.join(outcomes)})")

    # ------------------------------------------------------------------ a start short of ranks
    def start(self, build: Callable[[StoreGroup], Backend], min_ranks: int) -> Backend:
        """Starts the job's ranks together (``min_ranks``: see the module docstring): waits up to the deadline
        for every rank, then builds epoch 1 with those that came (at least ``min_ranks``), the others absent;
        a rank that comes after that joins as a replacement (``join``). Returns the committed backend; raises
        CommTimeoutError when fewer than ``min_ranks`` came, RuntimeError when a member failed the start."""
        begin = time.monotonic()
        self.admissions.arrive(host_id())
        members, absent = self.admissions.start_members(min_ranks, begin + self.timeout_s)
        if members is None:
            raise CommTimeoutError("Buffer()", self.rank, self.timeout_s, absent,
                                   f"fewer than min_ranks={min_ranks} ranks started"
                                   + (" (this rank came after that was decided)" if self.rank in absent else "")
                                   + ": the job starts with the ranks that came once at least min_ranks did, "
                                     "the others' slots reserved")
        if self.rank not in members:  # the start went without it: its slot is reserved, and it fills it
            return self.join(build)
        runtime, outcome = self._enter(START_EPOCH, build, sorted(members), lambda: (), frozenset(absent))
        self._record(START_EPOCH, members, outcome, begin, start=True)
        if runtime is None:
            raise RuntimeError(f"Buffer(): rank {self.rank}: the start of ranks {sorted(members)} failed: {outcome}")
        return runtime

    # ------------------------------------------------------------------ the survivors
    def admit(self, joiners: frozenset[int], build: Callable[[StoreGroup], Backend],
              exited: Callable[[], Iterable[int]], masked: frozenset[int]) -> Optional[Backend]:
        """Builds the next epoch with ``joiners`` (decided in one handshake on every survivor), the other
        ``masked`` ranks absent from it; ``exited()``: ranks on this host whose process has exited (the old
        backend's view). Returns the committed backend, or None when the epoch was aborted (the caller keeps
        its backend; the joiners' announcements are withdrawn, so they are not tried again until they
        announce anew)."""
        start = time.monotonic()
        epoch = self.epoch + 1
        absent = frozenset(masked) - joiners
        tokens = self.admissions.ready(joiners)
        # read after the tokens: a member that aborted this epoch before this survivor came here set its decision
        # before its joiners announced themselves anew, and their new tokens are for a later epoch (inviting them
        # here would spend one of their tries on an aborted epoch, and withdrawing them would lose them)
        if self.admissions.decision(epoch) is not None:
            tokens = {}
        self.admissions.invite(tokens, epoch, absent)
        here = host_id()

        def dead() -> Iterable[int]:  # members known dead: a survivor that exited, a joiner whose process is gone
            # (a joiner's rank names its dead predecessor there, an absent rank a dead process of no member)
            gone = {r for r in exited() if r not in joiners and r not in absent}
            for r, token in tokens.items():
                host, pid = (int(part, 16) if i == 0 else int(part) for i, part in enumerate(token.split(":")[:2]))
                if host == here and not process_alive(pid):
                    gone.add(r)
            return gone

        survivors = [r for r in range(self.num_ranks) if r not in joiners and r not in absent]
        runtime, outcome = self._enter(epoch, build, survivors, dead, absent)
        self._record(epoch, joiners, outcome, start)
        self.admissions.withdraw(tokens)  # admitted, or aborted: either way not to be tried again
        return runtime

    # ------------------------------------------------------------------ handles
    def keep_handle(self, handle: tuple) -> None:
        """Notes a dispatch's handle as one of the current epoch."""
        self._handles.append(weakref.ref(handle[0]))

    def check_handle(self, op: str, handle: object) -> None:
        """Raises ValueError naming ``handle`` when a dispatch of an earlier epoch returned it."""
        first = handle[0] if isinstance(handle, tuple) and handle else None
        for ref, epoch in self._retired:
            if first is not None and ref() is first:
                bad_argument(op, "handle", f"a handle of a dispatch in epoch {self.committed} (ranks were admitted at a "
                             f"later dispatch, which ended the epoch whose rows it names)",
                             f"a handle from epoch {epoch}")

    def _retire_handles(self, epoch: int) -> None:
        self._retired = [(ref, e) for ref, e in self._retired if ref() is not None] + \
            [(ref, epoch) for ref in self._handles if ref() is not None]
        self._handles.clear()

    # ------------------------------------------------------------------ both
    def _enter(self, epoch: int, build: Callable[[StoreGroup], Backend], survivors: Sequence[int],
               dead: Callable[[], Iterable[int]], absent: frozenset[int]) -> tuple[Optional[Backend], str]:
        """Builds this rank's side of ``epoch`` (``absent``: its ranks that no process holds, masked from the
        start) and runs the commit: (the backend or None, the outcome). ``dead()``: members known to have died
        (their side will never come: abort at once)."""
        self.epoch = epoch  # an aborted epoch's number is not used again: its keys hold its decision
        deadline = time.monotonic() + self.timeout_s + 2 * STORE_WAIT_S
        runtime, why, times = None, "", [time.monotonic()]
        try:
            group = self._connect(epoch, deadline - STORE_WAIT_S, dead, absent)
            times.append(time.monotonic())
            runtime = self.watch(build(group))
            for r in absent:
                runtime.mask_rank(r, True)
        except Exception as exc:  # a member died or never came: every member aborts, below
            why = f"{type(exc).__name__}: {exc}"
        times += [time.monotonic()] * (3 - len(times))
        decision = self.admissions.decide(epoch, runtime is not None, deadline, survivors, dead, absent)
        times.append(time.monotonic())
        #: seconds of the last epoch's parts: connecting its group, building the backend, the commit round
        self.parts = {name: b - a for name, a, b in zip(("connect", "build", "commit"), times, times[1:])}
        if decision == COMMIT:
            self._retire_handles(self.committed)
            self.committed = epoch
            return runtime, decision
        if runtime is not None:
            runtime.destroy()
        return None, why or f"another member of epoch {epoch} failed to build it, or the deadline passed"

    def _connect(self, epoch: int, deadline: float, dead: Callable[[], Iterable[int]],
                 absent: frozenset[int]) -> StoreGroup:
        """The epoch's group, connected on a helper thread that is given up on at ``deadline``, as soon as a
        member is known dead, or once a member aborted the epoch. Why not gloo's own timeout: it retries a
        refused connection (a member that died after it published its address) several times over, each with
        the whole timeout."""
        def gone() -> Optional[str]:
            ranks = sorted(dead())
            if ranks:
                return f"ranks {ranks} exited before it connected"
            return "a member aborted the epoch" if self.admissions.decision(epoch) == ABORT else None

        return bounded(lambda: StoreGroup.connect(self.admissions.store, self.admissions.epoch_scope(epoch), self.rank,
                                                  self.num_ranks, self.timeout_s, self.global_ranks, absent),
                       max(deadline - time.monotonic(), 0.0), f"epoch {epoch}: rank {self.rank}: its group", gone,
                       "a member did not connect")

    def _record(self, epoch: int, joiners: frozenset[int], outcome: str, began: float, *, start: bool = False) -> None:
        self.history.append({"epoch": epoch, "ranks": sorted(joiners), "outcome": outcome, "start": start,
                             "seconds": time.monotonic() - began, **self.parts})
