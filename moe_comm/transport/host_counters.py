"""Counters that the ranks of one host share through a memory-mapped file, for fault reports.

A transport whose own channel cannot tell who is late (MPI) has every rank store how many
exchanges it has entered; after a missed deadline a rank reads its host peers' counts without any
communication. Mapping and unmapping are local: nothing to free collectively.
"""
from __future__ import annotations

import mmap
import os
import tempfile

import torch

__all__ = ["HostCounters"]


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostCounters:
    """One int64 per host rank in the file named by ``token`` (the same on every rank of the host).

    Every host rank opens it (creating it if first); once all have (the caller's barrier), each
    calls ``unlink`` so that the name disappears while the mapping lives on.
    """

    def __init__(self, token: str, count: int, index: int) -> None:
        self.path = os.path.join(_directory(), f"moe-comm-counters-{token}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 8 * count)  # zero-filled; the same size from every opener
            self._map = mmap.mmap(fd, 8 * count)
        finally:
            os.close(fd)
        self.values = torch.frombuffer(self._map, dtype=torch.int64, count=count)
        self._index = index

    def store(self, value: int) -> None:
        """Sets this rank's counter."""
        self.values[self._index] = value

    def unlink(self) -> None:
        """Removes the file's name (idempotent across the host's ranks)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
