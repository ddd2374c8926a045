"""The cuda_host backend's communication buffers: one shared-memory segment per rank, mapped by every
rank of the host, as CUDA IPC maps every GPU's buffer into its peers (``cudaIpcOpenMemHandle``).

A buffer grows on demand: its size follows from the call's agreed shapes, so every rank asks for the
same size in the same call, and the remapping is collective over the buffer's transport.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...transport import Transport
from ...transport.shm_segment import SEGMENT_DIR, Segment, segment_name, sweep_stale

__all__ = ["SharedBuffers"]

_NAME_BYTES = 128


@dataclass(frozen=True)
class _Size:
    total_bytes: int


class SharedBuffers:
    """One named buffer of every rank of ``transport`` (all on this host), mapped here.

    Attributes:
        bases: ``[R]`` addresses of every rank's buffer in this process; pids: every rank's process.
    """

    def __init__(self, transport: Transport, what: str) -> None:
        self.transport, self.what = transport, what
        self.nbytes = 0
        self.bases: list[int] = []
        self._segments: list[Segment] = []
        pid = torch.tensor([os.getpid()], dtype=torch.int64)
        self.pids = transport.all_gather_rows(pid, op=f"cuda_host: {what} buffer").view(-1).tolist()

    def ensure(self, nbytes: int, skip: frozenset[int] = frozenset()) -> bool:
        """Maps buffers of at least ``nbytes`` (collective over the ranks not in ``skip``, masked ranks,
        when they must grow; every rank asks for the same size). A masked rank's base is 0: the kernels
        never touch a masked rank. Returns whether they were (re)mapped, zeroed."""
        if nbytes <= self.nbytes:
            return False
        op = f"cuda_host: mapping the {self.what} buffers"
        sweep_stale()
        mine = Segment.create(segment_name(), _Size(nbytes))
        try:
            row = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
            row[:len(mine.name)] = torch.tensor(list(mine.name.encode()), dtype=torch.uint8)
            names = [bytes(r).rstrip(b"\0").decode()
                     for r in self.transport.all_gather_rows(row, op=op, skip=skip).tolist()]
            segments = [mine if r == self.transport.rank else None if r in skip else Segment.open(name, _Size(nbytes))
                        for r, name in enumerate(names)]
            self.transport.barrier(op=op, skip=skip)
        finally:
            mine.unlink()
        self._segments, self.nbytes = segments, nbytes
        self.bases = [0 if s is None else s.base for s in segments]
        return True

    def peers(self, ranks: Sequence[int]) -> list[int]:
        """What a kernel object takes for these ranks' buffers (``Internode``'s rail, ``LowLatency``'s
        peers): their addresses here."""
        return [self.bases[r] for r in ranks]

    def unmapped(self, skip: frozenset[int]) -> list[int]:
        """Ranks outside ``skip`` whose buffer is not mapped here (mapped while they were masked)."""
        return [r for r, base in enumerate(self.bases) if not base and r not in skip]

    def zero_own(self, start: int = 0, end: Optional[int] = None) -> None:
        """Zeroes bytes [start, end) of this rank's buffer (to its end by default; its peers must not
        be writing to it)."""
        if self._segments:
            self._segments[self.transport.rank].bytes[start:end].zero_()

    def limit(self) -> int:
        """The most bytes a buffer may be reserved with up front: every rank of the host maps as much,
        so its share of half the host's shared memory (the same figure on every rank)."""
        shm = os.statvfs(SEGMENT_DIR)
        return shm.f_blocks * shm.f_frsize // (2 * self.transport.num_ranks)

    def own(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of this rank's buffer at ``offset`` (a view, uint8 on the CPU)."""
        return self._segments[self.transport.rank].view(offset, nbytes)

    def close(self) -> None:
        """Drops the mappings (a kernel that still ran on them would fault: callers close after the last)."""
        self._segments, self.bases, self.nbytes = [], [], 0
