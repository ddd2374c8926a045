"""The cuda backend's communication buffers: one GPU allocation per rank (``moe_comm._cuda.SharedBuffer``,
cudaMalloc'd and zeroed), mapped into every rank of the node with CUDA IPC. ``SharedBuffers``'
interface (``shared_buffers.py``), so the kernel modes drive both builds alike.

A buffer grows on demand: its size follows from the call's agreed shapes, so every rank asks for the
same size in the same call, and the remapping is collective over the buffer's transport: every rank
unmaps its peers' old buffers, allocates its new one and all-gathers its IPC handle (as a row of
uint8; the all-gather is also the point after which no rank maps an old buffer, so each frees its own),
opens the peers' handles, and meets the others at a barrier. Teardown is collective too
(``close``: unmap the peers, a barrier, free), as freeing an allocation a peer still maps is undefined.

Tested here with a fake ``moe_comm._cuda``: nothing of this has run on a GPU.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from ...transport import Transport
from .own_device_buffer import OwnDeviceBuffer

__all__ = ["IpcBuffers"]

Guard = Callable[[], ContextManager[Any]]


class IpcBuffers(OwnDeviceBuffer):
    """One named GPU buffer of every rank of ``transport`` (all on one node), mapped here.

    ``module`` is ``moe_comm._cuda`` (``SharedBuffer``, ``memset``, ``synchronize``); ``guard()`` makes
    the buffer's GPU current while allocating and zeroing.

    Attributes:
        bases: ``[R]`` addresses of every rank's buffer in this process (device pointers); pids:
            every rank's process; nbytes: the size of each buffer (0 before the first ``ensure``).
    """

    def __init__(self, transport: Transport, what: str, module: Any, guard: Guard = contextlib.nullcontext,
                 reach: Optional[Sequence[int]] = None) -> None:
        self.transport, self.what, self._runtime, self._guard = transport, what, module, guard
        #: the ranks whose buffers are mapped here (None: all; across hosts, the ranks of this node)
        self.reach = None if reach is None else frozenset(reach)
        self.nbytes = 0
        self.bases: list[int] = []
        self._own: Optional[Any] = None  # this rank's SharedBuffer
        pid = torch.tensor([os.getpid()], dtype=torch.int64, device=transport.device)
        self.pids = transport.all_gather_rows(pid, op=f"cuda: {what} buffer").view(-1).tolist()

    def ensure(self, nbytes: int, skip: frozenset[int] = frozenset()) -> bool:
        """Maps buffers of at least ``nbytes`` (collective when they must grow; every rank asks for
        the same size). Returns whether they were (re)mapped, zeroed. The caller has waited for every
        launch on the old buffers."""
        if nbytes <= self.nbytes:
            return False
        op = f"cuda: mapping the {self.what} buffers"
        if skip:  # CUDA IPC opens every peer's handle: a masked rank has none to give
            raise RuntimeError(f"{op}: {nbytes} bytes are needed after ranks {sorted(skip)} were masked, and the "
                               f"buffers cannot grow without them; size them up front (num_rdma_bytes from "
                               f"Buffer.get_low_latency_rdma_size_hint covers every low-latency call of that shape)")
        old, self._own, self.bases, self.nbytes = self._own, None, [], 0
        if old is not None:
            old.close_peers()
        with self._guard():
            mine = self._runtime.SharedBuffer(nbytes)
        try:
            handle = mine.handle()
            row = torch.tensor(list(handle), dtype=torch.uint8, device=self.transport.device)
            handles = [bytes(r) if self.reach is None or i in self.reach else b""
                       for i, r in enumerate(self.transport.all_gather_rows(row, op=op).cpu().tolist())]
            if old is not None:  # every rank has unmapped it (they all reached the all-gather)
                old.close()
                old = None
            bases = mine.open(handles, self.transport.rank)
            self.transport.barrier(op=op)
        except BaseException:
            mine.close()
            if old is not None:
                old.close()
            raise
        self._own, self.bases, self.nbytes = mine, list(bases), nbytes
        return True

    def peers(self, ranks: Sequence[int]) -> list[int]:
        """What a kernel object takes for these ranks' buffers (``Internode``'s rail, ``LowLatency``'s
        peers): their addresses here."""
        return [self.bases[r] for r in ranks]

    def unmapped(self, skip: frozenset[int]) -> list[int]:
        """Ranks outside ``skip`` and ``reach``'s complement whose buffer is not mapped here."""
        return [r for r, base in enumerate(self.bases)
                if not base and r not in skip and (self.reach is None or r in self.reach)]

    def _own_span(self) -> Optional[tuple[int, int]]:
        return None if self._own is None else (self._own.ptr, self._own.bytes)

    def close_peers(self) -> None:
        """Unmaps the peers' buffers (the first step of a collective teardown). Idempotent."""
        if self._own is not None:
            self._own.close_peers()
        self.bases = []

    def free(self, collective: bool = True) -> None:
        """Frees this rank's buffer: after every rank has unmapped it (``close_peers`` and a barrier; a
        broken buffer's peers may never come, so then without: ``collective`` changes nothing here).
        Idempotent."""
        own, self._own, self.bases, self.nbytes = self._own, None, [], 0
        if own is not None:
            own.close()

    def close(self, collective: bool = True) -> None:
        """Collective teardown: unmap the peers' buffers, a barrier (unless ``collective`` is False:
        a broken buffer's peers may never come), free this rank's. Idempotent."""
        if self._own is None:
            return
        self.close_peers()
        try:
            if collective:
                self.transport.barrier(op=f"cuda: unmapping the {self.what} buffers")
        finally:
            self.free()
