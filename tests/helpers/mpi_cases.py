"""Rank functions for test_mpi: buffers on an mpi4py communicator, subgroups, argument errors, abort."""
from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import moe_comm

from helpers.fault_cases import _dispatch
from helpers.shm_cases import low_latency_digests, normal_digests

M, H, E = 24, 512, 12

# A buffer that outlives one call, for the abort test.
_KEPT: dict[str, moe_comm.Buffer] = {}


def _digests(**kw: Any) -> list[str]:
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E)
    buf = moe_comm.Buffer(num_rdma_bytes=hint, low_latency_mode=True, timeout_s=30, explicitly_destroy=True, **kw)
    try:
        return normal_digests(buf) + low_latency_digests(buf, M, H, E)
    finally:
        buf.destroy()


def comm_and_group(group: dist.ProcessGroup) -> dict[str, Any]:
    """The same calls on a buffer over MPI.COMM_WORLD (no group), over the torch group with the mpi
    transport, and with the collective transport; and what the comm buffer reports."""
    from mpi4py import MPI
    buf = moe_comm.Buffer(None, comm=MPI.COMM_WORLD, timeout_s=30)
    info = dict(group=buf.group, rank=buf.rank, size=buf.group_size, transport=buf.transport_name)
    return dict(info=info, comm=_digests(group=None, comm=MPI.COMM_WORLD),
                mpi=_digests(group=group, transport="mpi"), collective=_digests(group=group, transport="collective"))


def subgroup(group: dist.ProcessGroup) -> Any:
    """A torch subgroup of the even ranks and an MPI communicator split the same way give the
    collective transport's bits (the subgroup's MPI twin is made by the transport)."""
    from mpi4py import MPI
    rank = dist.get_rank(group)
    evens = list(range(0, dist.get_world_size(group), 2))
    sub = dist.new_group(evens)  # collective over the whole group
    split = MPI.COMM_WORLD.Split(rank % 2, rank)
    try:
        if rank % 2:
            return None
        return dict(mpi=_digests(group=sub, transport="mpi"), comm=_digests(comm=split),
                    collective=_digests(group=sub, transport="collective"))
    finally:
        split.Free()
        dist.destroy_process_group(sub)


def bad_arguments(group: dist.ProcessGroup) -> dict[str, tuple[str, str]]:
    """(exception, message) of each misuse of ``comm``."""
    from mpi4py import MPI
    runtime = moe_comm.Buffer(None, comm=MPI.COMM_WORLD).runtime.transport
    size = dist.get_world_size(group)
    rows = torch.zeros(size, 4)
    cases = {
        "not_cpu": lambda: runtime.all_to_all(rows, torch.zeros(size, 4, device="meta"), [1] * size, [1] * size,
                                              op="all_to_all"),
        "strided": lambda: runtime.all_to_all(rows, torch.zeros(4, size).t(), [1] * size, [1] * size,
                                              op="all_to_all"),
        "shm_with_comm": lambda: moe_comm.Buffer(None, comm=MPI.COMM_WORLD, transport="shm"),
        "comm_null": lambda: moe_comm.Buffer(None, comm=MPI.COMM_NULL),
        "ranks_differ": lambda: moe_comm.Buffer(group, comm=MPI.COMM_SELF),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = ("no exception", "")
        except Exception as exc:  # the test checks which
            out[name] = (type(exc).__name__, str(exc))
    return out


def mpi_transport_outside_mpiexec(group: dist.ProcessGroup) -> tuple[str, str, list[str]]:
    """``transport='mpi'`` in ranks that are not one MPI job (each is an MPI singleton); with the
    MPICH segments the rank maps (named in /dev/shm until it finalises MPI)."""
    from moe_comm.transport.mpi import mapped_mpich_segments
    try:
        moe_comm.Buffer(group, transport="mpi", timeout_s=30)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc), mapped_mpich_segments()
    return "no exception", "", mapped_mpich_segments()


def time_out_then_refuse(group: dist.ProcessGroup, timeout_s: float) -> Any:
    """The last rank skips a dispatch; the others time out, and then their buffer refuses to run
    (its collective is still in flight) at once instead of waiting again. The ranks meet at a barrier
    first: building the buffer is collective too, under the same deadline (``timeout_s`` >= MEET_S)."""
    dist.barrier(group)
    left = time.time()
    try:
        buf = moe_comm.Buffer(group, timeout_s=timeout_s, explicitly_destroy=True)
    except moe_comm.CommTimeoutError as exc:  # when each rank left the barrier tells a late rank from a stuck MPI
        raise AssertionError(f"rank {dist.get_rank()} left the barrier at {left:.3f} (wall clock) and timed out "
                             f"building its Buffer {time.time() - left:.1f} s later") from exc
    _KEPT["buf"] = buf
    if buf.rank == buf.group_size - 1:
        return "skipped"
    try:
        _dispatch(buf)
    except moe_comm.CommTimeoutError as exc:
        timeout = (str(exc), exc.missing_ranks)
    start = time.monotonic()
    try:
        _dispatch(buf)
    except RuntimeError as exc:
        return timeout, str(exc), time.monotonic() - start
    return "no refusal"


def destroy_kept(group: dist.ProcessGroup) -> str:
    """Destroys the buffer kept by ``time_out_then_refuse``: after a timeout it aborts the job."""
    _KEPT.pop("buf").destroy()
    return "destroyed"


def many_buffers(group: dist.ProcessGroup, count: int) -> int:
    """Builds and drops ``count`` mpi buffers (more than MPI has communicator ids for, if they leaked);
    returns how many were built."""
    for _ in range(count):
        moe_comm.Buffer(group, transport="mpi", timeout_s=30)
    return count


def skip_construction(group: dist.ProcessGroup, timeout_s: float) -> Any:
    """The last rank never builds its comm buffer; the others time out in the constructor."""
    from mpi4py import MPI
    if dist.get_rank(group) == dist.get_world_size(group) - 1:
        return "skipped"
    start = time.monotonic()
    try:
        moe_comm.Buffer(None, comm=MPI.COMM_WORLD, timeout_s=timeout_s)
    except moe_comm.CommTimeoutError as exc:
        return time.monotonic() - start, str(exc)
    return "no timeout"


def rows_of_a_peer_that_exits(group: dist.ProcessGroup, timeout_s: float) -> Any:
    """Rank 1 sends its row to rank 0 and exits; rank 0's wait looks for exited peers only once rank 1 is gone
    (its exited_ranks is made to wait for that), after polls that found the row not yet there: the interleaving
    of a peer that sends and exits between a wait's poll and its look. Rank 2 sits the exchange out. Returns
    rank 0's received rows (the wait must take in what rank 1 sent before it exited)."""
    from moe_comm.transport.mpi import MpiTransport
    transport = MpiTransport(group, timeout_s)
    rank = transport.rank
    if rank == 2:
        return "sat out"
    rows, received = torch.full((3, 8), float(rank + 1)), torch.zeros(3, 8)
    splits = [1, 1, 0]
    if rank == 1:
        time.sleep(0.5)  # rank 0 polls and finds nothing first
        transport.all_to_all(received, rows, splits, splits, op="exchange", skip=frozenset({2})).wait()
        os._exit(0)
    look = transport.exited_ranks

    def look_once_rank_1_is_gone() -> list[int]:
        until = time.monotonic() + timeout_s
        while 1 not in look() and time.monotonic() < until:
            time.sleep(0.01)
        return look()

    transport.exited_ranks = look_once_rank_1_is_gone  # type: ignore[method-assign]
    transport.all_to_all(received, rows, splits, splits, op="exchange", skip=frozenset({2})).wait()
    return received[:2, 0].tolist()


def a_peer_done_and_gone_while_another_is_late(group: dist.ProcessGroup, late_s: float) -> Any:
    """One exchange of 3 ranks in which ranks 0 and 2 send each other nothing: rank 2 finishes its part
    with rank 1 and exits, while rank 0 posts ``late_s`` late. Rank 1's wait finds rank 2 exited while
    rank 0's row is still missing; it must go on (rank 2 owes it nothing more) and take in both rows.
    Returns the first column of the received rows."""
    from moe_comm.transport.mpi import MpiTransport
    transport = MpiTransport(group, 30.0)
    rank = transport.rank
    sent = [[1, 1, 0], [1, 1, 1], [0, 1, 1]]  # rows from rank i to rank j
    send_splits, recv_splits = sent[rank], [row[rank] for row in sent]
    rows, received = torch.full((sum(send_splits), 8), float(rank + 1)), torch.zeros(sum(recv_splits), 8)
    if rank == 0:
        time.sleep(late_s)
    transport.bulk_all_to_all(received, rows, recv_splits, send_splits, op="exchange").wait()
    if rank == 2:
        os._exit(0)
    return received[:, 0].tolist()
