"""One rank's POSIX shared-memory segment: synchronisation flags, metadata cells and data slots.

Layout, for L ranks on the host (local index 0..L-1) and NUM_SLOTS slots per channel:

    flags   arrived[channel][slot][source], then consumed[channel][slot]: int64, one per 64-byte line
    meta    NUM_SLOTS x L cells of META_CELL bytes; cell (slot, i) is written by local rank i
    data    NUM_SLOTS slots of ``capacity`` bytes; every source writes its block at its own offset

Segments live in /dev/shm (what ``shm_open`` uses on Linux) under names starting with PREFIX and
the creator's pid. The owner unlinks its segment as soon as every peer has mapped it, so a crash
afterwards leaves nothing behind; ``sweep_stale`` removes segments whose creator died before that.
"""
from __future__ import annotations

import mmap
import os
import secrets
import time
from dataclasses import dataclass

import torch

from .._native import native

__all__ = ["META", "DATA", "NUM_SLOTS", "META_CELL", "PREFIX", "SegmentLayout", "Segment", "segment_name",
           "sweep_stale"]

META, DATA = 0, 1  # channels: small all-to-alls, payload exchanges
NUM_SLOTS = 2      # per channel: DeepEP's double buffering
META_CELL = 64 << 10
PREFIX = "moe_comm_"
_DIR = "/dev/shm"
_LINE = 64
_PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets inside a segment for ``num_local`` ranks and data slots of ``capacity`` bytes."""

    num_local: int
    capacity: int

    def arrived(self, channel: int, slot: int, source: int) -> int:
        return ((channel * NUM_SLOTS + slot) * self.num_local + source) * _LINE

    def consumed(self, channel: int, slot: int) -> int:
        return (2 * NUM_SLOTS * self.num_local + channel * NUM_SLOTS + slot) * _LINE

    @property
    def meta_offset(self) -> int:
        return _round_up(self.consumed(DATA, NUM_SLOTS - 1) + _LINE, _PAGE)

    def meta_cell(self, slot: int, source: int) -> int:
        return self.meta_offset + (slot * self.num_local + source) * META_CELL

    def data_slot(self, slot: int) -> int:
        return self.meta_cell(NUM_SLOTS, 0) + slot * self.capacity

    @property
    def total_bytes(self) -> int:
        return self.data_slot(NUM_SLOTS)


def segment_name() -> str:
    """A fresh segment name carrying this process's pid (so a stale one can be recognised)."""
    return f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


class Segment:
    """A mapped segment. The mapping lives as long as this object and any tensor taken from it."""

    def __init__(self, name: str, layout: SegmentLayout, mapping: mmap.mmap) -> None:
        self.name, self.layout = name, layout
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()

    @staticmethod
    def create(name: str, layout: SegmentLayout) -> "Segment":
        """Creates, sizes (reserving the memory: a full /dev/shm is an error here, not a SIGBUS
        later) and maps a new zeroed segment."""
        fd = os.open(os.path.join(_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, layout.total_bytes)
            except OSError as exc:
                os.unlink(os.path.join(_DIR, name))
                raise RuntimeError(f"shm transport: cannot reserve {layout.total_bytes} bytes in {_DIR} for "
                                   f"segment {name} ({exc}); free space there, pass smaller num_nvl_bytes / "
                                   f"num_rdma_bytes, or use transport='collective'") from exc
            return Segment(name, layout, _map(fd, layout.total_bytes))
        finally:
            os.close(fd)

    @staticmethod
    def open(name: str, layout: SegmentLayout) -> "Segment":
        """Maps a peer's segment."""
        fd = os.open(os.path.join(_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != layout.total_bytes:
                raise RuntimeError(f"shm transport: segment {name} has {size} bytes, expected {layout.total_bytes}")
            return Segment(name, layout, _map(fd, size))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Removes the name (mappings stay valid). Idempotent."""
        try:
            os.unlink(os.path.join(_DIR, self.name))
        except FileNotFoundError:
            pass

    def flag(self, offset: int) -> int:
        """Address of the int64 flag at ``offset``."""
        return self.base + offset

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.bytes[offset:offset + nbytes]


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: fault every page in now rather than on the first exchange.
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


# A live segment keeps its name only while its ranks map it (seconds); an older one whose creator is
# not a running process here was left by a crash. The age guards against a creator that runs in
# another pid namespace sharing /dev/shm, whose pid looks dead from here.
STALE_AFTER_S = 60.0


def sweep_stale() -> list[str]:
    """Unlinks moe-comm segments in /dev/shm older than STALE_AFTER_S whose creating process is not
    running; returns their names."""
    removed = []
    try:
        names = os.listdir(_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("_", 1)[0]
        path = os.path.join(_DIR, name)
        try:
            if not pid.isdigit() or native().process_alive(int(pid)) or now - os.stat(path).st_mtime < STALE_AFTER_S:
                continue
            os.unlink(path)
            removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            pass
    return removed
