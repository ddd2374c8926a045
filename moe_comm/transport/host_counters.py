"""Counters that the ranks of one host share through a memory-mapped file, for fault reports.

A transport whose own channel cannot tell who is late (MPI) has every rank store how many
exchanges it has entered; after a missed deadline a rank reads its host peers' counts without any
communication. Mapping and unmapping are local: nothing to free collectively.

The file is named for the whole host, so a rank that dies before the ranks' barrier (after which
each unlinks the name) would leave it. Every opener therefore holds it as ``shm_segment`` holds a
segment (a shared flock for as long as the process maps it), and ``shm_segment.sweep_stale`` removes
it once nobody does; opening one sweeps the host first.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from typing import Callable

import torch

from .shm_segment import COUNTERS_PREFIX, create_held, open_held, sweep_stale

__all__ = ["HostCounters"]


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class HostCounters:
    """Two int64 per host rank in the file named by ``token`` (the same on every rank of the host):
    the exchanges it has entered (``entered``) and those it has finished (``finished``).

    Every host rank opens it (creating it if first); once all have (the caller's barrier), each
    calls ``unlink`` so that the name disappears while the mapping lives on. A file whose ranks all
    died before that is removed by the next sweep (any moe-comm start-up on the host).
    """

    def __init__(self, token: str, count: int, index: int) -> None:
        directory = _directory()
        sweep_stale(directory)
        name = f"{COUNTERS_PREFIX}{token}"
        self.path = os.path.join(directory, name)
        nbytes = 2 * 8 * count
        fd = _open_or_create(directory, name, nbytes)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise RuntimeError(f"HostCounters: {self.path} has {size} bytes, expected {nbytes} "
                                   f"({count} host ranks); the host's ranks disagree on their number")
            # NOTES: the mapping keeps the open file, and with it this rank's hold, after the fd is closed.
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        both = torch.frombuffer(self._map, dtype=torch.int64, count=2 * count)
        self.entered, self.finished = both[:count], both[count:]
        self._index = index

    @staticmethod
    def meet(token: str, host_ranks: list[int], rank: int, barrier: Callable[[], None]) -> "HostCounters":
        """The host's counters as every host rank opens them: opens the file named by ``token``, waits
        in ``barrier`` (a barrier of the whole group, so every host rank has opened it by then) and
        unlinks the name. Collective through ``barrier``; a failure sweeps the host's moe-comm files
        (a peer that died after opening the file held it)."""
        try:
            counters = HostCounters(token, len(host_ranks), host_ranks.index(rank))
            try:
                barrier()
            finally:
                counters.unlink()
        except BaseException:
            sweep_stale()
            raise
        return counters

    def store(self, value: int) -> None:
        """Sets this rank's count of exchanges entered."""
        self.entered[self._index] = value

    def store_finished(self, value: int) -> None:
        """Sets this rank's count of exchanges finished."""
        self.finished[self._index] = value

    def unlink(self) -> None:
        """Removes the file's name (idempotent across the host's ranks)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _open_or_create(directory: str, name: str, nbytes: int) -> int:
    """A held fd of the file: the existing one, else a new zeroed one of ``nbytes`` (the first opener
    creates it; a name that a sweep removes in between is created afresh)."""
    path = os.path.join(directory, name)
    while True:
        try:
            return open_held(path)
        except FileNotFoundError:
            pass
        try:
            return create_held(directory, name, nbytes)
        except FileExistsError:  # another rank created it meanwhile: open that one
            continue
