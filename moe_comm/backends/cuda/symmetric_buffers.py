"""The cuda backend's buffers across hosts: NVSHMEM's symmetric memory (``moe_comm._cuda_nvshmem``).

One NVSHMEM world per process: every rank of the buffer's group is one PE (PE = rank), joined once by a
unique id that rank 0 makes and the group's transport all-gathers (no MPI, no launcher support needed).
NVSHMEM sizes its symmetric heap once, at init, from ``NVSHMEM_SYMMETRIC_SIZE`` (its default, 1 GiB, is
below DeepEP's decode-shape buffers): unless the user has set it, ``join_world`` sets it to the largest
``heap_bytes`` of the ranks (the same on every PE, as the heap is symmetric) and logs that it did. It sets
no other NVSHMEM variable: the transport (IBGDA, IBRC, ...) stays NVSHMEM's choice and the user's.
``SymmetricBuffers`` has the interface of ``SharedBuffers`` / ``IpcBuffers`` (``ensure``, ``zero_own``,
``peers``, ``unmapped``, ``close``), so the kernel modes drive it alike; what it gives a kernel object for
a set of ranks is ``(base, p2p, pes)``: this rank's symmetric buffer, each rank's buffer as mapped here
where NVLink reaches it (``nvshmem_ptr``; 0 across nodes, where the kernels put through NVSHMEM), and
each rank's PE.

NVSHMEM's allocation and free are collective over every PE and wait without a deadline, so each one
is preceded by a barrier of the transport (which has the buffer's deadline): every rank has arrived
before any enters NVSHMEM. Compiled and tested here with a stand-in for the module only: nothing of
this has run on a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from ...transport import Transport
from .own_device_buffer import OwnDeviceBuffer

__all__ = ["HEAP_VARIABLE", "SymmetricBuffers", "heap_bytes", "join_world"]

_log = logging.getLogger(__name__)

Guard = Callable[[], ContextManager[Any]]


#: NVSHMEM's variable for the size of its symmetric heap (read once, at init).
HEAP_VARIABLE = "NVSHMEM_SYMMETRIC_SIZE"


def heap_bytes(buffer_bytes: int) -> int:
    """The symmetric heap a Buffer of DeepEP's ``max(num_nvl_bytes, num_rdma_bytes)`` asks for: room for the
    low-latency buffers (their layout takes up to twice DeepEP's, staging the rows that cross nodes) and
    the normal-mode RDMA rings, at least 1 GiB."""
    return max(1 << 30, 2 * buffer_bytes + (512 << 20))


def join_world(transport: Transport, module: Any, guard: Guard = contextlib.nullcontext, heap: int = 1 << 30) -> None:
    """Makes this process PE ``transport.rank`` of an NVSHMEM world of the transport's ranks (collective),
    with a symmetric heap of the largest ``heap`` bytes of the ranks unless ``NVSHMEM_SYMMETRIC_SIZE`` is set;
    or checks that it already is one: one process serves one world, so every Buffer across hosts in a
    process must be built on the same ranks."""
    op = "cuda: joining NVSHMEM"
    rank, size = transport.rank, transport.num_ranks
    if module.initialized():
        if (module.my_pe(), module.n_pes()) != (rank, size):
            raise RuntimeError(f"{op}: NVSHMEM is already initialized in this process as PE {module.my_pe()} of "
                               f"{module.n_pes()}, and this Buffer's group makes it rank {rank} of {size}; a process "
                               f"serves one NVSHMEM world, so build every Buffer that spans hosts on the same ranks")
        return
    uid = module.unique_id() if rank == 0 else bytes(module.UNIQUE_ID_BYTES)
    row = torch.tensor(list(uid) + list(heap.to_bytes(8, "little")), dtype=torch.uint8, device=transport.device)
    rows = transport.all_gather_rows(row, op=op).cpu()
    n = module.UNIQUE_ID_BYTES
    if HEAP_VARIABLE not in os.environ:
        largest = max(int.from_bytes(bytes(r[n:].tolist()), "little") for r in rows)
        os.environ[HEAP_VARIABLE] = str(largest)
        _log.info("moe_comm: %s=%d (NVSHMEM's symmetric heap, sized for this Buffer; set it to override)",
                  HEAP_VARIABLE, largest)
    with guard():
        module.init(bytes(rows[0][:n].tolist()), rank, size)


class SymmetricBuffers(OwnDeviceBuffer):
    """One named symmetric buffer of every rank (nvshmem_malloc'd, zeroed), grown on demand.

    Attributes:
        pids: every rank's process (for messages); nbytes: each buffer's size (0 before ``ensure``).
    """

    def __init__(self, transport: Transport, what: str, module: Any, device_module: Any,
                 guard: Guard = contextlib.nullcontext) -> None:
        self.transport, self.what, self.module, self._guard = transport, what, module, guard
        self._runtime = device_module  # moe_comm._cuda: memset, memcpy and synchronize on raw pointers
        self.nbytes = 0
        self.base = 0
        self._p2p: list[int] = []
        pid = torch.tensor([os.getpid()], dtype=torch.int64, device=transport.device)
        self.pids = transport.all_gather_rows(pid, op=f"cuda: {what} buffer").view(-1).tolist()

    def ensure(self, nbytes: int, skip: frozenset[int] = frozenset()) -> bool:
        """Allocates buffers of at least ``nbytes`` on every PE (collective when they must grow; every rank
        asks for the same size); returns whether they were (re)allocated, zeroed. The caller has waited for
        every launch on the old ones."""
        if nbytes <= self.nbytes:
            return False
        op = f"cuda: allocating the {self.what} buffers"
        if skip:  # every PE takes part in NVSHMEM's allocation: a masked rank cannot
            raise RuntimeError(f"{op}: {nbytes} bytes are needed after ranks {sorted(skip)} were masked, and "
                               f"NVSHMEM allocates on every rank at once; size them up front (num_rdma_bytes from "
                               f"Buffer.get_low_latency_rdma_size_hint covers every low-latency call of that shape)")
        self.transport.barrier(op=op)  # everyone is here before anyone blocks in NVSHMEM
        with self._guard():
            if self.base:
                old, self.base, self.nbytes, self._p2p = self.base, 0, 0, []
                self.module.free(old)
            self.base = self.module.alloc(nbytes)
            self._p2p = [self.module.peer_ptr(self.base, pe) for pe in range(self.transport.num_ranks)]
        self.nbytes = nbytes
        return True

    def peers(self, ranks: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """What a kernel object takes for these ranks: (this rank's base, each one's buffer mapped here or
        0, each one's PE)."""
        ranks = list(ranks)
        return self.base, [self._p2p[r] for r in ranks], ranks

    def unmapped(self, skip: frozenset[int]) -> list[int]:
        """Every PE reaches every other: none is unmapped."""
        return []

    def _own_span(self) -> Optional[tuple[int, int]]:
        return (self.base, self.nbytes) if self.base else None

    def close_peers(self) -> None:
        """Nothing is mapped per peer (NVSHMEM maps the world)."""

    def free(self, collective: bool = True) -> None:
        """Frees this rank's buffer after every rank's ``close_peers`` and a barrier (the caller's), when
        ``collective``: NVSHMEM's free is collective, so a broken buffer, whose peers may never come, leaves
        its memory to the world's end. Idempotent."""
        base, self.base, self.nbytes, self._p2p = self.base, 0, 0, []
        if base and collective:
            with self._guard():
                self.module.free(base)
