"""The ``mpi`` transport: MPI's own all-to-all-v (mpi4py), for jobs launched with ``mpirun``.

Rows travel as one derived datatype per row size (a contiguous run of the row's bytes), so counts
and displacements are row counts (no 2^31-byte limit) and CPU tensors are handed to MPI by address,
without copies. Every exchange is a non-blocking ``Ialltoallv`` (``Isend``/``Irecv`` pairs when
ranks are masked), polled against the buffer's deadline; like the ``collective`` transport, small
``all_to_all`` exchanges run on a communicator of their own, so they never queue behind a payload.

MPI does not move data between calls into the library (no progress thread), so an exchange posted
with ``async_finish`` or a receive hook completes when it is waited on. Waits poll ``MPI_Testall``
and yield the core between polls, as MPI's own blocking waits spin.

Faults: each rank counts the exchanges it has entered, and those it has finished, in a memory-mapped
file of its host (``host_counters``), so a rank that misses the deadline names the host ranks that
never arrived, and whether their process has exited; a wait that finds a peer exited fails at once
unless that peer had finished the exchange (it sent its rows and exited while another rank was late).
Construction duplicates the communicator with ``Idup``, polled like the exchanges, so a rank that
never builds its buffer is a timeout too. MPI cannot
cancel a collective: after a timeout the transport refuses further exchanges, and when the buffer
is destroyed, or the interpreter exits, it aborts the job (``MPI_Abort`` on ``COMM_WORLD``) instead
of leaving it to hang in ``MPI_Finalize``.
"""
from __future__ import annotations

import atexit
import datetime
import os
import secrets
import sys
import threading
import time
import weakref
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..core.checks import describe
from ..core.errors import CommTimeoutError, PeerExitedError, bad_argument
from ..core.native import native
from ..core.topology import split_nodes
from .base import Pending, Transport, host_id, peer_blocks, prefix_sums
from .collective import default_store
from .host_counters import HostCounters
from .shm_segment import sweep_stale
from .store_gather import StoreGather

__all__ = ["MpiTransport", "load_mpi", "as_comm", "MPICH_SHM_PREFIX", "mapped_mpich_segments"]

_LIVENESS_EVERY_S = 0.05
#: polls after a peer was seen exited, to take in what it sent before it exited
_DRAIN_POLLS = 100
_SHM_DIR = "/dev/shm"
#: MPICH's segment of a host's ranks: created in MPI_Init, named (in /dev/shm) until MPI_Finalize.
MPICH_SHM_PREFIX = "mpich_shm_"


def mapped_mpich_segments(pid: str = "self") -> list[str]:
    """Names of the MPICH segments in /dev/shm that process ``pid`` maps and that still have their
    name (``/proc/<pid>/maps``); [] where that cannot be read."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                path = fields[5].rstrip("\n") if len(fields) == 6 else ""
                if path.startswith(f"{_SHM_DIR}/{MPICH_SHM_PREFIX}") and not path.endswith(" (deleted)"):
                    names.add(path[len(_SHM_DIR) + 1:])
    except OSError:
        pass
    return sorted(names)


def load_mpi() -> Any:
    """``mpi4py.MPI``, imported on first use (it initialises MPI); ImportError says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("the 'mpi' transport needs mpi4py and an MPI library: pip install 'moe-comm[mpi]' "
                          "(mpi4py with the mpich wheel), then launch with mpirun") from exc
    return MPI


def as_comm(op: str, comm: Any) -> Any:
    """``comm`` checked to be a usable mpi4py intra-communicator (TypeError/ValueError naming ``comm``)."""
    mpi = load_mpi()
    if isinstance(comm, mpi.Comm) and comm == mpi.COMM_NULL:
        bad_argument(op, "comm", "a valid communicator", "MPI.COMM_NULL")
    if not isinstance(comm, mpi.Intracomm):
        bad_argument(op, "comm", "an mpi4py intra-communicator (e.g. MPI.COMM_WORLD)", describe(comm),
                     kind=TypeError)
    return comm


def _comm_of_group(group: dist.ProcessGroup, timeout_s: float) -> tuple[Any, bool]:
    """The ranks of torch.distributed ``group`` as an MPI communicator of the same ranks, in the same
    order, and whether it was created here (else it is ``MPI.COMM_WORLD``). Needs every process of
    the torch world to be the MPI process of the same rank (as with ``mpirun`` and
    ``moe_comm.launch.init_from_env``)."""
    mpi = load_mpi()
    world = mpi.COMM_WORLD
    torch_rank, torch_size = dist.get_rank(), dist.get_world_size()
    if (world.Get_rank(), world.Get_size()) != (torch_rank, torch_size):
        raise RuntimeError(f"Buffer: transport 'mpi' on a torch.distributed group needs torch rank r to be "
                           f"MPI.COMM_WORLD rank r; got torch rank {torch_rank} of {torch_size}, MPI rank "
                           f"{world.Get_rank()} of {world.Get_size()} (launch with mpirun, or pass comm=...)")
    ranks = dist.get_process_group_ranks(group)
    if ranks == list(range(torch_size)):
        return world, False
    # MPI_Comm_create_group blocks until every member calls it and has no non-blocking form: meet
    # on the torch group first, with the deadline.
    try:
        dist.barrier(group, async_op=True).wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CommTimeoutError("Buffer()", dist.get_rank(group), timeout_s, None,
                               f"the group's barrier before creating its MPI communicator failed: {exc}") from exc
    members = world.Get_group().Incl(ranks)
    try:
        return world.Create_group(members), True
    finally:
        members.Free()


#: An exchange in flight: its MPI requests and the tensors they read and write.
_Flight = tuple[list, tuple]


class _MpiPending:
    """An exchange in flight (the transport keeps its tensors alive until its requests complete);
    ``index``: the count of exchanges this rank had entered with it."""

    def __init__(self, transport: "MpiTransport", requests: list, op: str, index: int) -> None:
        self._transport, self._requests, self._op, self._index = transport, requests, op, index
        self._counted = False

    def wait(self) -> None:
        requests, self._requests = self._requests, []
        if requests:
            self._transport.wait_for(requests, self._op, self._index)
        if not self._counted:
            self._counted = True
            self._transport.count_finished()


def _done(flight: _Flight) -> bool:
    return load_mpi().Request.Testall(flight[0])


# Exchanges still in flight when their transport was garbage collected: their tensors must outlive
# MPI's use of them, and nobody will wait for them any more.
_ORPHANS: list[_Flight] = []


def _release(mpi: Any, comms: list, types: dict, inflight: list[_Flight]) -> None:
    """Frees a transport's communicators and datatypes (local calls); keeps unfinished exchanges'
    tensors alive."""
    _ORPHANS.extend(f for f in inflight if not _done(f))
    inflight.clear()
    if mpi.Is_finalized():
        return
    for row in types.values():
        row.Free()
    types.clear()
    for comm in comms:
        comm.Free()
    comms.clear()


class MpiTransport(Transport):
    """Alltoallv over an mpi4py communicator (or over the MPI twin of a torch.distributed group)."""

    name = "mpi"
    posts_in_background = True  # low-latency rows move on a thread (MPI_THREAD_MULTIPLE): the send half never waits

    def __init__(self, group: Union[dist.ProcessGroup, Any], timeout_s: float, buffer_bytes: int = 0) -> None:
        """Collective over ``group``: a torch.distributed group whose ranks are the same MPI ranks,
        or an mpi4py communicator, within the deadline. Works on two duplicates of the communicator
        (payloads, metadata), so its messages never meet the caller's; they are freed with the
        transport (``close`` or garbage collection). ``buffer_bytes`` is unused: buffers are
        allocated per exchange. CPU tensors only."""
        super().__init__()
        self._mpi = load_mpi()
        self.timeout_s = timeout_s
        self.device = torch.device("cpu")
        self._types: dict[int, Any] = {}
        # NOTES: plain (requests, tensors) pairs: a pending object here would hold the transport in a
        # cycle and delay the finalizer that frees its communicators.
        self._inflight: list[_Flight] = []
        self._requests_lock = threading.Lock()
        self._comms: list[Any] = []
        self._failed: Optional[str] = None
        self._counters: Optional[HostCounters] = None
        self._host_ranks: list[int] = []
        self._entered = 0  # exchanges this rank has posted
        self._finished = 0  # and those it has waited for to the end
        self.pids: list[int] = []
        self._finalizer = weakref.finalize(self, _release, self._mpi, self._comms, self._types, self._inflight)
        if isinstance(group, dist.ProcessGroup):
            parent, created = _comm_of_group(group, timeout_s)
        else:
            parent, created = group, False
        self.rank, self.num_ranks = parent.Get_rank(), parent.Get_size()
        self._bulk = parent if created else self._dup(parent)
        self._comms.append(self._bulk)
        self._meta = self._dup(self._bulk)
        self._comms.append(self._meta)
        self._meet()

    def _dup(self, comm: Any) -> Any:
        """``comm`` duplicated (non-blocking, so a rank that never comes is a timeout, not a hang)."""
        dup, request = comm.Idup()
        self.wait_for([request], "Buffer()")
        return dup

    def _meet(self) -> None:
        """Swaps (host, pid, token) with every rank and maps this host's arrival counters (the
        file named by the host's first rank's token). A failure here sweeps the host's moe-comm
        files: a peer that died after opening the counters file, before this rank did, held it."""
        mine = torch.tensor([host_id(), os.getpid(), secrets.randbits(62)], dtype=torch.int64)
        try:
            rows = self.all_gather_rows(mine, op="Buffer()").tolist()
            self._host_ranks = [r for r, row in enumerate(rows) if row[0] == rows[self.rank][0]]
            self.pids = [row[1] for row in rows]
            whole = self.num_ranks == self._mpi.COMM_WORLD.Get_size()  # emulated nodes count world ranks
            self.nodes = split_nodes([row[0] for row in rows], list(range(self.num_ranks)) if whole else None)
            counters = HostCounters.meet(f"{rows[self._host_ranks[0]][2]:x}", self._host_ranks, self.rank,
                                         lambda: self.barrier(op="Buffer()"))
        except BaseException:
            sweep_stale()
            raise
        self._counters = counters
        store = default_store() if dist.is_initialized() else None
        if store is not None:  # the job's ranks also form a torch.distributed world: its store serves
            self.gatherer = StoreGather(store, f"moe_comm/mpi/{rows[0][2]:x}/shrink", self.rank, self.timeout_s,
                                        self.exited_ranks)

    # ------------------------------------------------------------------ posting
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str,
                   skip: frozenset[int] = frozenset()) -> Pending:
        return self._post(self._meta, output, input, output_splits, input_splits, op, skip)

    def bulk_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], *, op: str, skip: frozenset[int] = frozenset()) -> Pending:
        return self._post(self._bulk, output, input, output_splits, input_splits, op, skip)

    def _post(self, comm: Any, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
              input_splits: Sequence[int], op: str, skip: frozenset[int]) -> Pending:
        if self._failed is not None:
            raise RuntimeError(f"{op}: rank {self.rank}: the mpi transport is unusable after {self._failed} "
                               f"(MPI cannot cancel a collective); the communicator is aborted when this "
                               f"Buffer is destroyed or the process exits")
        for name, tensor in (("input", input), ("output", output)):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                layout = "" if tensor.is_contiguous() else ", not contiguous"
                raise ValueError(f"{op}: the mpi transport moves contiguous CPU tensors; {name} is "
                                 f"{describe(tensor)}{layout}")
        with self._requests_lock:  # posts enter their rows' exchanges from a thread of their own
            self._entered += 1
            index = self._entered
            if self._counters is not None:
                self._counters.store(self._entered)
        row = self._row_type(output, input)
        if row is None:  # zero-width rows on every rank: nothing to move
            requests = []
        elif skip:
            requests = self._point_to_point(comm, row, output, input, output_splits, input_splits, skip)
        else:
            requests = [comm.Ialltoallv(_spec(input, input_splits, row), _spec(output, output_splits, row))]
        with self._requests_lock:
            self._inflight[:] = [f for f in self._inflight if not _done(f)] + [(requests, (output, input))]
        return _MpiPending(self, requests, op, index)

    def _row_type(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        """The committed datatype of one row (bytes of ``input``'s trailing dimensions); None for
        rows of no bytes."""
        nbytes = input.element_size() * int(torch.Size(input.shape[1:]).numel())
        if output.element_size() * int(torch.Size(output.shape[1:]).numel()) != nbytes:
            raise ValueError(f"all_to_all: output rows and input rows differ in size: {describe(output)} vs "
                             f"{describe(input)}")
        if nbytes == 0:
            return None
        row = self._types.get(nbytes)
        if row is None:
            row = self._types[nbytes] = self._mpi.BYTE.Create_contiguous(nbytes).Commit()
        return row

    def _point_to_point(self, comm: Any, row: Any, output: torch.Tensor, input: torch.Tensor,
                        output_splits: Sequence[int], input_splits: Sequence[int], skip: frozenset[int]) -> list:
        """The all-to-all as sends and receives between the ranks not in ``skip`` (a collective
        would wait for them). Blocks of skipped ranks stay as they are."""
        requests = []
        for peer, send, recv in peer_blocks(output, input, output_splits, input_splits, self.rank, skip):
            if send.shape[0]:
                requests.append(comm.Isend([_memory(send), send.shape[0], row], peer))
            if recv.shape[0]:
                requests.append(comm.Irecv([_memory(recv), recv.shape[0], row], peer))
        return requests

    # ------------------------------------------------------------------ waiting
    def _test(self, requests: list) -> bool:
        # NOTES: Testall frees the requests it finds complete; posts test other exchanges' requests
        # (``_inflight``), and a post's rows move on a thread of their own, so tests take turns
        with self._requests_lock:
            return self._mpi.Request.Testall(requests)

    def wait_for(self, requests: list, op: str, index: int = 0) -> None:
        """Polls ``requests`` until all complete; past the deadline raises CommTimeoutError (and marks
        the transport failed), and PeerExitedError as soon as a host rank's process has exited, unless
        that rank had finished this exchange (``index``, see ``count_finished``) before it exited."""
        start = time.monotonic()
        deadline, next_check = start + self.timeout_s, start + _LIVENESS_EVERY_S
        while not self._test(requests):
            now = time.monotonic()
            if now >= deadline:
                self._fail(f"a timeout in {op}")
                self._raise_timeout(op)
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                for peer in self.exited_ranks():
                    # what it sent before it exited is in MPI's queues: polls after the exit was seen take
                    # it in (it may have sent and exited between the last poll and the look)
                    if any(self._test(requests) for _ in range(_DRAIN_POLLS)):
                        return
                    if self._finished_before_exit(peer, index):
                        continue  # what is missing is a live rank's
                    self._fail(f"rank {peer} exited during {op}")
                    raise PeerExitedError(op, self.rank, peer, self.pids[peer])
            # NOTES: MPI moves a large message between two processes of a host only while both poll,
            # chunk by chunk, so a wait that sleeps between polls stalls its peers too (1 ms naps made a
            # 4-rank low-latency dispatch 11x slower). Yielding lets ranks that share a core run.
            os.sched_yield()

    def count_finished(self) -> None:
        """Counts an exchange waited for to the end, in the host's counters: a peer that sees this rank
        exited then knows whether it took part in the peer's exchange to the end (it had finished every
        exchange it entered, that one among them)."""
        with self._requests_lock:
            self._finished += 1
            if self._counters is not None:
                self._counters.store_finished(self._finished)

    def _finished_before_exit(self, peer: int, index: int) -> bool:
        """Whether exited host rank ``peer`` had finished every exchange it entered, this rank's
        ``index``-th among them. Exchanges are entered in the same order on every rank that takes part
        in them; where masks made the counts differ the answer may be wrong, which costs a wait no more
        than its deadline (the wait goes on, and completes only with every row)."""
        if self._counters is None or not index:
            return False
        at = self._host_ranks.index(peer)
        entered, finished = int(self._counters.entered[at]), int(self._counters.finished[at])
        return finished == entered >= index

    def _raise_timeout(self, op: str) -> None:
        """CommTimeoutError naming the host ranks behind this one (all ranks when all share the host)."""
        if self._counters is None:  # still meeting: nobody can tell
            raise CommTimeoutError(op, self.rank, self.timeout_s, None)
        counts = self._counters.entered.tolist()
        late = [r for r, n in zip(self._host_ranks, counts) if n < self._entered]
        exited = ", ".join(f"rank {r} (pid {self.pids[r]}) has exited" for r in late if r in self.exited_ranks())
        off_host = self.num_ranks - len(self._host_ranks)
        if off_host:  # their counters live on their own hosts
            raise CommTimeoutError(op, self.rank, self.timeout_s, None,
                                   f"late on this host: {late}; {off_host} ranks on other hosts not checked"
                                   + (f"; {exited}" if exited else ""))
        raise CommTimeoutError(op, self.rank, self.timeout_s, late, exited)

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            self._failed = reason
            atexit.register(self._abort)

    def _abort(self) -> None:
        """Ends the job: a collective left in flight cannot be finished or cancelled. First unlinks
        MPICH's segments of this host (the processes keep their mappings): only MPI_Finalize unlinks
        them, and an aborted job never gets there."""
        if self._failed is None or self._mpi.Is_finalized():
            return
        sys.stderr.write(f"moe-comm: rank {self.rank}: aborting the MPI communicator after {self._failed}\n")
        sys.stderr.flush()
        for name in mapped_mpich_segments():
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:  # a peer was first
                pass
        self._mpi.COMM_WORLD.Abort(1)

    # ------------------------------------------------------------------ the rest
    def exited_ranks(self) -> list[int]:
        return [r for r in self._host_ranks if r != self.rank and not native().process_alive(self.pids[r])]

    def close(self) -> None:
        # the posts still on the thread first (one deadline): their requests must be posted, and waited for below,
        # before the communicators are freed under them (a hooked combine left pending hung 4 ranks at destroy)
        self._close_poster(self.timeout_s + 1.0)
        if self._failed is not None:
            self._abort()
        for requests, _ in list(self._inflight):
            self.wait_for(requests, "Buffer.destroy")
        self._finalizer()
        self.workspace.clear()


def _memory(tensor: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, as an MPI buffer (no copy)."""
    return load_mpi().buffer.fromaddress(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _spec(tensor: torch.Tensor, splits: Sequence[int], row: Any) -> list:
    """An mpi4py vector buffer spec: ``tensor``'s rows in blocks of ``splits`` rows."""
    counts = [int(n) for n in splits]
    return [_memory(tensor), (counts, prefix_sums(counts)[:-1]), row]
