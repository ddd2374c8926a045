"""The ``collective`` transport: ``torch.distributed.all_to_all_single`` with uneven splits.

Works on every backend that implements ``all_to_all_single`` (gloo on CPU, nccl, hccl, cncl, ...)
and on any device, with no copy through the host. It is the semantic reference that the other
transports are tested against.

Two channels: on gloo, the small ``all_to_all`` exchanges (handshakes, counts) run on a second gloo
group of the same ranks, because gloo runs one group's collectives strictly in order: a handshake
posted while a payload is in flight would otherwise wait for the whole payload (a 16-byte all-to-all
behind a 16 MB one took 6.8 ms instead of 0.4 ms here), and with it any overlap of the next step.
Payloads (``bulk_all_to_all``) run on the group itself.

Deadlines: every exchange is posted asynchronously and waited with the buffer's deadline. Before
posting, each rank records how many exchanges it has entered, so a rank that times out can name the
ranks that never arrived, and say whether a peer on this host has exited (ranks swap host and pid
when the transport is built). Ranks of one host count in a shared counters file, read without any
communication; ranks on other hosts count in the process group's store, which is only read on a
helper thread with a bounded wait: a store whose host is stopped never answers, and a dead one
raises, and neither may hold up or replace the error that names the late rank.

Exit after a failure: an exchange on the group itself that failed (a deadline, a lost peer) stays posted
in gloo, which cannot cancel it; at interpreter exit the group's teardown would wait for it until the
group's own timeout (300 s under ``init_from_env``, 30 min by torch's default), after an exit barrier that
cannot complete. Such a failure aborts the group at exit instead (``_abort_group_at_exit``).
"""
from __future__ import annotations

import atexit
import collections
import datetime
import os
import secrets
import threading
import time
from typing import Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..core.errors import CommTimeoutError, CrossRankMismatchError
from ..core.topology import split_nodes
from .base import Pending, Transport, host_id, peer_blocks
from .host_counters import HostCounters
from .store_gather import StoreGather
from .store_group import StoreGroup, gloo_backend, members_places

__all__ = ["CollectiveTransport"]

# Types gloo's all-to-all cannot carry; they travel as their bytes.
_BYTE_VIEW_DTYPES = {d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bool",
    "uint16", "uint32", "uint64", "complex64", "complex128")) if d is not None}


def _as_wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend will send it: dtypes it lacks as bytes (splits count rows, so a
    wider last dimension changes nothing)."""
    return tensor.view(torch.uint8) if tensor.dtype in _BYTE_VIEW_DTYPES else tensor


_KEEP_RECENT = 6  # exchanges whose tensors stay referenced: two operations' worth


#: longest wait for the rendezvous store on an error path (what it adds to the buffer's deadline)
STORE_WAIT_S = 1.0

T = TypeVar("T")


def bounded(call: Callable[[], T], timeout_s: float, what: str,
            give_up: Optional[Callable[[], Optional[str]]] = None, late: str = "the rendezvous store did not answer") -> T:
    """``call()`` (a store operation, a group's connection) on a helper thread, waited for at most ``timeout_s``:
    a TCP store whose host is stopped never answers, whatever its own timeout. Raises TimeoutError naming ``what``
    and ``late`` past it, or RuntimeError with what ``give_up()`` returns as soon as that is not None (asked every
    50 ms); the thread is left to finish or fail on its own."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    helper = threading.Thread(target=run, name="moe-comm store", daemon=True)
    helper.start()
    deadline = time.monotonic() + timeout_s
    while helper.is_alive() and time.monotonic() < deadline:
        reason = give_up() if give_up is not None else None
        if reason is not None:
            raise RuntimeError(f"{what}: {reason}")
        helper.join(min(deadline - time.monotonic(), 0.05) if give_up is not None else timeout_s)
    if helper.is_alive():
        raise TimeoutError(f"{what}: {late} within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class _ArrivalBook:
    """How many exchanges each rank has entered: host ranks in a shared counters file, ranks on other
    hosts in the store (written without waiting for an answer, read with a bounded wait)."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self._rank, self._num_ranks = rank, num_ranks
        self._host_ranks: list[int] = [rank]
        self._counters: Optional[HostCounters] = None
        self._store: Optional[dist.Store] = None
        self._prefix = ""
        self.store_trouble = ""  # why the store stopped being used, if it did
        self.entered = 0
        self._lock = threading.Lock()

    def attach(self, host_ranks: list[int], counters: HostCounters, store: Optional[dist.Store],
               prefix: str) -> None:
        """Starts counting: ``counters`` for ``host_ranks``, ``store`` (when some rank runs on another
        host) for the rest."""
        self._host_ranks, self._counters = host_ranks, counters
        self._store = store if len(host_ranks) < self._num_ranks else None
        self._prefix = prefix

    def enter(self) -> None:
        with self._lock:  # posts enter their rows' exchanges from a thread of their own
            self.entered += 1
            if self._counters is not None:
                self._counters.store(self.entered)
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{self._rank}", str(self.entered))
            except RuntimeError as exc:  # the store's host is gone: the exchange itself will say who
                self._store, self.store_trouble = None, f"the rendezvous store failed ({exc})"

    def missing(self) -> tuple[Optional[list[int]], str]:
        """(ranks that have entered fewer exchanges than this one, or None when some could not be
        read; a note on what could not be read). Blocks at most STORE_WAIT_S."""
        if self._counters is None:  # still meeting: nobody can tell
            return None, ""
        counts = dict(zip(self._host_ranks, self._counters.entered.tolist()))
        others = [r for r in range(self._num_ranks) if r not in counts]
        note = self.store_trouble
        if others and self._store is not None:
            store, keys = self._store, [f"{self._prefix}/{r}" for r in others]

            def read() -> list[int]:
                return [int(store.get(k)) if store.check([k]) else 0 for k in keys]
            try:
                counts.update(zip(others, bounded(read, STORE_WAIT_S, "counting late ranks")))
            except (TimeoutError, RuntimeError) as exc:
                note = f"ranks on other hosts could not be checked ({exc})"
        elif others:
            note = note or "ranks on other hosts could not be checked (no rendezvous store)"
        if len(counts) < self._num_ranks:
            late = sorted(r for r, n in counts.items() if n < self.entered)
            return None, f"late on this host: {late}; {note}"
        return sorted(r for r, n in counts.items() if n < self.entered), note


class _Meeting:
    """A buffer's construction in the rendezvous store: each rank writes (host, pid) on arrival, so that
    a failed meeting names the ranks that never came, and those of this host that have exited."""

    def __init__(self, store: Optional[dist.Store], prefix: str, rank: int, num_ranks: int, host: int) -> None:
        self._store, self._prefix, self._num_ranks, self._host = store, prefix, num_ranks, host
        if store is not None:
            try:
                bounded(lambda: store.set(f"{prefix}/{rank}", f"{host}:{os.getpid()}"), STORE_WAIT_S,
                        "Buffer(): arriving")
            except (TimeoutError, RuntimeError):
                self._store = None  # the meeting itself will fail and say so

    def missing(self) -> tuple[Optional[list[int]], str]:
        """(ranks that have not come within STORE_WAIT_S or whose process on this host has exited, a
        note), or (None, why not). A peer's failure may end the meeting before slower ranks arrive:
        they get until STORE_WAIT_S to write."""
        store = self._store
        if store is None:
            return None, "no rendezvous store to tell who came"
        keys = [f"{self._prefix}/{r}" for r in range(self._num_ranks)]

        def read() -> list[Optional[str]]:
            deadline = time.monotonic() + STORE_WAIT_S / 2
            while True:
                seen = [store.get(k).decode() if store.check([k]) else None for k in keys]
                if all(v is not None for v in seen) or time.monotonic() >= deadline:
                    return seen
                time.sleep(0.02)
        try:
            seen = bounded(read, STORE_WAIT_S, "counting the ranks that came")
        except (TimeoutError, RuntimeError) as exc:
            return None, f"the rendezvous store could not tell who came ({exc})"
        late, exited = [], []
        for r, value in enumerate(seen):
            if value is None:
                late.append(r)
                continue
            host, pid = (int(v) for v in value.split(":"))
            if host == self._host and not process_alive(pid):
                late.append(r)
                exited.append(f"rank {r} (pid {pid}) has exited")
        return late, ", ".join(exited)


def _wait_work(work: dist.Work, deadline: float) -> None:
    """Waits for ``work`` until ``deadline`` (``time.monotonic``); a backend error or timeout raises RuntimeError."""
    work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))


_ABORT_AT_EXIT: set[int] = set()  # ids of the groups whose abort at exit is registered


def _abort_group_at_exit(group: dist.ProcessGroup) -> None:
    """Registers (once per group) an abort of ``group`` at interpreter exit: a failed exchange left posted
    on it would hold up its teardown (and ``init_from_env``'s exit barrier) until the group's timeout."""
    if id(group) in _ABORT_AT_EXIT:
        return
    _ABORT_AT_EXIT.add(id(group))

    def abort() -> None:
        try:  # NOTES: private API (torch >= 2.4): aborts the group's backends and unregisters it
            dist.distributed_c10d._abort_process_group(group)
        except Exception:  # noqa: BLE001 (destroyed meanwhile, or a torch without it: the teardown waits)
            pass

    atexit.register(abort)


class _CollectivePending:
    def __init__(self, transport: "CollectiveTransport", works: list[dist.Work], op: str, on_group: bool) -> None:
        """``on_group``: the works were posted on the transport's process group itself."""
        self._transport, self._works, self._op, self._on_group = transport, works, op, on_group

    def wait(self) -> None:
        works, self._works = self._works, []
        transport = self._transport
        deadline = time.monotonic() + transport.timeout_s  # one deadline for all of the exchange's works
        for work in works:
            try:
                _wait_work(work, deadline)
            except RuntimeError as exc:
                if self._on_group:
                    _abort_group_at_exit(transport.group)
                transport.raise_failure(self._op, exc)


class CollectiveTransport(Transport):
    """``all_to_all_single`` over a ``torch.distributed`` process group."""

    name = "collective"

    def __init__(self, group: "dist.ProcessGroup | StoreGroup", timeout_s: float, buffer_bytes: int = 0, *,
                 between_nodes_only: bool = False) -> None:
        """Collective over ``group``: every rank of the group must construct it, in the same order
        as any other transport on the group (the n-th construction on each rank pairs up). A
        ``StoreGroup`` (an elastic Buffer's epoch) is used through its gloo backend directly.
        ``buffer_bytes`` is unused: buffers are allocated per exchange. ``between_nodes_only``: the caller
        (``shm``) moves rows through it only between nodes, so when every rank is on one node it builds
        no channels of its own (each is a gloo group to connect: tens of ms)."""
        super().__init__()
        self.group = group
        self.timeout_s = timeout_s
        if isinstance(group, StoreGroup):
            self.rank, self.num_ranks, self._backend = group.rank, group.size, "gloo"
            store, scope, global_ranks = group.store, group.scope, group.global_ranks
            self.absent = group.absent
        else:
            self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
            self._backend = str(dist.get_backend(group))
            store, scope = default_store(), f"moe_comm/{getattr(group, 'group_name', 'default')}"
            whole = self.num_ranks == dist.get_world_size()  # emulated nodes count world ranks
            global_ranks = [dist.get_global_rank(group, r) for r in range(self.num_ranks)] if whole else None
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._backend == "nccl" \
            else torch.device("cpu")
        #: each rank's place in this transport's gloo groups of its own (an epoch's: its members only)
        self._places = members_places(self.num_ranks, self.absent)
        instance = 0
        if store is not None:
            try:
                instance = bounded(lambda: store.add(f"{scope}/instances/{self.rank}", 1), timeout_s,
                                   "Buffer(): numbering this buffer")
            except (TimeoutError, RuntimeError) as exc:
                raise CommTimeoutError("Buffer()", self.rank, timeout_s, None, str(exc)) from exc
        self._book = _ArrivalBook(self.rank, self.num_ranks)
        # NOTES: gloo's worker thread drops its reference to a finished exchange shortly *after* the
        # waiter wakes up. If that is the last reference, the worker frees the work and its tensors,
        # which takes the GIL, and that aborts the process during interpreter exit. The works (and
        # tensors) of the last few exchanges stay referenced here, so the last reference is always
        # dropped by Python on the main thread, long after the worker has moved on.
        self._recent: collections.deque = collections.deque(maxlen=_KEEP_RECENT)
        self._host = host_id()
        # NOTES: a failure inside _meet reports liveness from _peers, so give it a placeholder first.
        self._peers = [(self._host, os.getpid())] * self.num_ranks
        self._closed = False
        self._metadata: Optional[dist.ProcessGroup] = None  # _meet runs on the group itself
        self._posts: Optional[dist.ProcessGroup] = None
        # who has come to this meeting, for its errors: ranks that never write here are the late ones
        self._meeting = _Meeting(store, f"{scope}/meeting/{instance}", self.rank, self.num_ranks, self._host)
        self._peers = self._meet(instance, store, f"{scope}/arrivals/{instance}")
        self._meeting = None
        #: each rank's place in the launcher's world, None when the group is not the whole world
        self.global_ranks = global_ranks
        self.nodes = split_nodes([host for host, _ in self._peers], global_ranks)
        if not (between_nodes_only and len(self.nodes) == 1):
            self._metadata = self._metadata_channel(store, f"{scope}/metadata/{instance}")
            # the rows of posts move on a thread (the send half never waits), on a group of their own: other
            # buffers of the group keep posting to it from the caller's thread, in their own order
            self._posts = self._metadata_channel(store, f"{scope}/posts/{instance}")
        self.posts_in_background = self._posts is not None
        if store is not None:
            self.gatherer = StoreGather(store, f"{scope}/shrink/{instance}", self.rank, timeout_s, self.exited_ranks)

    def _metadata_channel(self, store: Optional[dist.Store], prefix: str) -> Optional[dist.ProcessGroup]:
        """A gloo group of its own (for ``all_to_all``, see the module docstring; for rows of posts); None off gloo,
        for one rank, or without the rendezvous store. Every rank builds it after ``_meet`` (so the
        instances agree), within the deadline."""
        if self._backend != "gloo" or self.num_ranks == 1 or store is None:
            return None
        try:
            return bounded(lambda: gloo_backend(dist.PrefixStore(prefix, store), self._places[self.rank],
                                                len(self._places), self.timeout_s),
                           self.timeout_s + STORE_WAIT_S, "Buffer(): connecting the metadata group")
        except (TimeoutError, RuntimeError) as exc:
            self.raise_failure("Buffer()", exc)

    def _meet(self, instance: int, store: Optional[dist.Store], prefix: str) -> list[tuple[int, int]]:
        """Exchanges (host, pid, instance, token) with every rank, with the deadline; checks the
        pairing; starts the arrival book (host counters named by the host's first rank's token). An absent
        rank's row is zeros: host 0, which no rank's host hashes to, so it shares no node."""
        mine = torch.tensor([self._host, os.getpid(), instance, secrets.randbits(62)], dtype=torch.int64,
                            device=self.device)
        rows = self.all_gather_rows(mine, op="Buffer()").cpu().tolist()
        instances = {r: row[2] for r, row in enumerate(rows) if r not in self.absent}
        if len(set(instances.values())) > 1:
            raise CrossRankMismatchError(
                f"Buffer(): ranks have created different numbers of buffers on this group "
                f"({', '.join(f'rank {r}: {n}' for r, n in instances.items())}); create buffers collectively, "
                f"in the same order on every rank")
        host_ranks = [r for r, row in enumerate(rows) if row[0] == self._host]
        counters = HostCounters.meet(f"{rows[host_ranks[0]][3]:x}", host_ranks, self.rank,
                                     lambda: self.barrier(op="Buffer()"))
        self._book.attach(host_ranks, counters, store, prefix)
        return [(host, pid) for host, pid, _, _ in rows]

    @property
    def peers(self) -> list[tuple[int, int]]:
        """(host hash, pid) of every rank."""
        return list(self._peers)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str,
                   skip: frozenset[int] = frozenset()) -> Pending:
        return self._post(output, input, output_splits, input_splits, op, skip, self._metadata)

    def bulk_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], *, op: str, skip: frozenset[int] = frozenset()) -> Pending:
        return self._post(output, input, output_splits, input_splits, op, skip, None)

    def posted_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                          input_splits: Sequence[int], *, op: str) -> Pending:
        return self._post(output, input, output_splits, input_splits, op, frozenset(), self._posts)

    def _post(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
              input_splits: Sequence[int], op: str, skip: frozenset[int],
              channel: Optional[dist.ProcessGroup]) -> Pending:
        """Starts the all-to-all on ``channel`` (the metadata group, whose ranks are the group's) or,
        when None, on the group itself."""
        if self._closed:  # (a post still on its thread when close gave up waiting: never onto the group)
            raise RuntimeError(f"{op}: rank {self.rank}: this Buffer's collective transport is closed (Buffer.destroy)")
        self._book.enter()
        skip = skip | self.absent
        on_group = channel is None and not isinstance(self.group, StoreGroup)
        if self.num_ranks == 1:
            if input.numel():
                output.copy_(input)
            return _CollectivePending(self, [], op, False)
        try:
            if skip:
                works = self._point_to_point(output, input, output_splits, input_splits, skip, channel)
            elif channel is not None:
                works = [channel.alltoall_base(_as_wire(output), _as_wire(input), [int(n) for n in output_splits],
                                               [int(n) for n in input_splits], dist.AllToAllOptions())]
            elif isinstance(self.group, StoreGroup):
                works = [self.group.backend.alltoall_base(_as_wire(output), _as_wire(input), list(output_splits),
                                                          list(input_splits), dist.AllToAllOptions())]
            else:
                works = [dist.all_to_all_single(_as_wire(output), _as_wire(input), list(output_splits),
                                                list(input_splits), group=self.group, async_op=True)]
        except RuntimeError as exc:
            if on_group:
                _abort_group_at_exit(self.group)
            self.raise_failure(op, exc)
        self._recent.append((works, output, input))
        return _CollectivePending(self, works, op, on_group)

    def _point_to_point(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], skip: frozenset[int],
                        channel: Optional[dist.ProcessGroup]) -> list[dist.Work]:
        """The all-to-all as sends and receives between the ranks not in ``skip`` (a collective
        would wait for them). Blocks of skipped ranks stay as they are."""
        works = []
        if channel is None and isinstance(self.group, StoreGroup):
            channel = self.group.backend
        for peer, send, recv in peer_blocks(output, input, output_splits, input_splits, self.rank, skip):
            if channel is not None:  # a gloo backend of its own (the metadata group, an epoch's group): tag 0
                if send.shape[0]:
                    works.append(channel.send([_as_wire(send)], self._places[peer], 0))
                if recv.shape[0]:
                    works.append(channel.recv([_as_wire(recv)], self._places[peer], 0))
                continue
            dst = dist.get_global_rank(self.group, peer)
            if send.shape[0]:
                works.append(dist.isend(_as_wire(send), dst, group=self.group))
            if recv.shape[0]:
                works.append(dist.irecv(_as_wire(recv), dst, group=self.group))
        return works

    def raise_failure(self, op: str, exc: Exception) -> None:
        """Re-raises a backend error as CommTimeoutError (deadline) or RuntimeError naming ranks;
        blocks at most STORE_WAIT_S."""
        missing, note = self._book.missing()
        if missing is None and self._meeting is not None:  # still meeting: the store says who came
            missing, note = self._meeting.missing()
        peers = [r for r in range(self.num_ranks) if r != self.rank]
        stopped = self._stopped(peers)
        if not missing and stopped:  # every rank entered the exchange: name the ones that stopped inside it
            missing = [r for r, _ in stopped]
        detail = ", ".join(part for part in (self._liveness(peers), ", ".join(
            f"rank {r} (pid {pid}) is stopped" for r, pid in stopped), note) if part)
        if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise CommTimeoutError(op, self.rank, self.timeout_s, missing, detail) from exc
        who = "unknown" if missing is None else str(missing)
        raise RuntimeError(f"{op}: rank {self.rank}: {self._backend} exchange failed ({exc}); "
                           f"ranks not heard from: {who}" + (f"; {detail}" if detail else "")) from exc

    def exited_ranks(self) -> list[int]:
        """Ranks on this host whose process has exited."""
        return [peer for peer, (host, pid) in enumerate(self._peers)
                if host == self._host and peer != self.rank and not process_alive(pid)]

    def _stopped(self, ranks: list[int]) -> list[tuple[int, int]]:
        """(rank, pid) of ``ranks`` on this host whose process is stopped (SIGSTOP, a debugger)."""
        return [(peer, pid) for peer in ranks for host, pid in [self._peers[peer]]
                if host == self._host and _process_state(pid) in ("T", "t")]

    def _liveness(self, ranks: list[int]) -> str:
        """Which of ``ranks`` run on this host and have exited."""
        dead = []
        for peer in ranks:
            peer_host, pid = self._peers[peer]
            if peer_host != self._host:
                continue
            if not process_alive(pid):
                dead.append(f"rank {peer} (pid {pid}) has exited")
        return ", ".join(dead)

    def close(self) -> None:
        """Waits (one deadline each) for the posts still on this transport's thread and for the exchanges
        it started, then drops its channels. Why: a post left on the thread would otherwise fall back to
        the group itself after its channel is gone, where the ranks' next Buffer meets, and gloo aborts
        the process on the mismatched sizes; the works' last references must not die on gloo's thread."""
        if self._closed:
            return
        self._close_poster(self.timeout_s + STORE_WAIT_S)
        self._closed = True
        deadline = time.monotonic() + self.timeout_s
        for works, _, _ in self._recent:
            # NOTES: only the works nobody waited for: waiting again for a finished send or receive of gloo
            # waits for another completion, which never comes (it cost every destroy after a masked call the
            # whole deadline)
            for work in (work for work in works if not work.is_completed()):
                try:  # every rank posted the same exchanges; a failure was (or will be) raised by its call
                    _wait_work(work, deadline)
                except RuntimeError:
                    pass
        self._book = _ArrivalBook(self.rank, self.num_ranks)
        self._recent.clear()
        self._metadata = self._posts = None
        self.workspace.clear()


def _process_state(pid: int) -> Optional[str]:
    """``pid``'s state letter from procfs (R, S, T, Z, ...); "" when it is gone, None without procfs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; an exited process that is not yet reaped (zombie) counts as dead."""
    state = _process_state(pid)
    if state is not None:
        return state not in ("", "Z", "X")
    try:  # no procfs: fall back to signal 0
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def default_store() -> Optional[dist.Store]:
    # NOTES: the default store is how torch.distributed itself rendezvoused; it is private API, so
    # losing it only costs the names of late ranks in timeout errors.
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
