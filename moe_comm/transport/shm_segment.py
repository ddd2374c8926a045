"""One rank's POSIX shared-memory segment: synchronisation flags, metadata cells and data slots.

Layout, for L ranks on the host (local index 0..L-1) and NUM_SLOTS slots per channel:

    flags   arrived[channel][slot][source], then consumed[channel][slot]: int64, one per 64-byte line
    meta    NUM_SLOTS x L cells of ``meta_cell_bytes(R)`` bytes; cell (slot, i) is written by local rank i
    data    NUM_SLOTS slots of ``capacity`` bytes; every source writes its block at its own offset

Segments live in /dev/shm (what ``shm_open`` uses on Linux) under names starting with PREFIX and
the creator's pid. The owner unlinks its segment as soon as every peer has mapped it, so a crash
afterwards leaves nothing behind. Until then the name is *held*: the creator has a shared ``flock``
on the file from before the name appears (the file is made nameless with O_TMPFILE, sized, locked,
then linked), and the lock lasts as long as any descriptor or mapping of the creator's, that is
until the creator exits, however it exits. ``sweep_stale`` removes every moe-comm file (segments,
and ``host_counters``' files, held the same way) that nobody holds: its creator died. The lock is on
the inode, so this holds across pid namespaces that share /dev/shm. Every start-up and growth
sweeps, and so does a rank that finds a peer exited or closes its transport.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from ..core.native import native

__all__ = ["SEGMENT_DIR", "META", "DATA", "NUM_SLOTS", "META_CELL", "PREFIX", "COUNTERS_PREFIX", "SegmentLayout", "Segment",
           "meta_cell_bytes",
           "segment_name", "create_held", "open_held", "process_gone", "sweep_stale"]

META, DATA = 0, 1  # channels: small all-to-alls, payload exchanges
NUM_SLOTS = 2      # per channel: DeepEP's double buffering
META_CELL = 64 << 10
PREFIX = "moe_comm_"
COUNTERS_PREFIX = "moe-comm-counters-"  # host_counters' files, swept with the segments
SEGMENT_DIR = "/dev/shm"  # where segments live (shared memory of this host)
_LINE = 64
_PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def meta_cell_bytes(num_ranks: int) -> int:
    """Bytes of one metadata cell for a group of ``num_ranks``: ``META_CELL``, or more where a low-latency post's
    header (``protocol/call_header.py``: 40 bytes a rank, 1 KiB of message, behind 8 bytes a rank of counts)
    would not fit, so the headers of any group size travel in one cell."""
    return max(META_CELL, _round_up(64 * num_ranks + 4096, _PAGE))


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets inside a segment for ``num_local`` ranks and data slots of ``capacity`` bytes."""

    num_local: int
    capacity: int
    cell: int = META_CELL  # bytes of one metadata cell (``meta_cell_bytes``)

    def arrived(self, channel: int, slot: int, source: int) -> int:
        return ((channel * NUM_SLOTS + slot) * self.num_local + source) * _LINE

    def consumed(self, channel: int, slot: int) -> int:
        return (2 * NUM_SLOTS * self.num_local + channel * NUM_SLOTS + slot) * _LINE

    @property
    def meta_offset(self) -> int:
        return _round_up(self.consumed(DATA, NUM_SLOTS - 1) + _LINE, _PAGE)

    def meta_cell(self, slot: int, source: int) -> int:
        return self.meta_offset + (slot * self.num_local + source) * self.cell

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
        later) and maps a new zeroed segment, held while this process maps it."""
        try:
            fd = create_held(SEGMENT_DIR, name, layout.total_bytes)
        except _NoSpace as exc:
            raise RuntimeError(f"shm transport: cannot reserve {layout.total_bytes} bytes in {SEGMENT_DIR} for "
                               f"segment {name} ({exc}); free space there, pass smaller num_nvl_bytes / "
                               f"num_rdma_bytes, or use transport='collective'") from exc.__cause__
        try:
            # NOTES: the mapping keeps the open file, and with it the lock, after the fd is closed.
            return Segment(name, layout, _map(fd, layout.total_bytes))
        except BaseException:
            _unlink_quietly(os.path.join(SEGMENT_DIR, name))
            raise
        finally:
            os.close(fd)

    @staticmethod
    def open(name: str, layout: SegmentLayout) -> "Segment":
        """Maps a peer's segment."""
        fd = os.open(os.path.join(SEGMENT_DIR, name), os.O_RDWR)
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
            os.unlink(os.path.join(SEGMENT_DIR, self.name))
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


# ---------------------------------------------------------------------- held files, the sweep
# NOTES: flock locks belong to the open file, which lives as long as any descriptor or mapping of it,
# so a holder that exits (crash and SIGKILL included) releases its lock. Not before its *last thread*
# has exited, though: a process's main thread can be a zombie (what process_alive calls exited) while
# its other threads still share, and hold, its files and memory (see process_gone).

class _NoSpace(OSError):
    """posix_fallocate failed (its OSError is the cause)."""


def create_held(directory: str, name: str, nbytes: int) -> int:
    """A read-write fd of a new file ``name`` in ``directory``, ``nbytes`` zeroed and reserved, on
    which this process has a shared flock from before the name exists, so no sweep ever sees the
    name unheld while this process runs. FileExistsError if the name exists.

    Equivalent to open(O_CREAT | O_EXCL) + posix_fallocate + flock(LOCK_SH) without a window between
    them (where O_TMPFILE is missing it is exactly that, with a window of a few microseconds)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fd, named = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd), False
        except (AttributeError, OSError):  # no O_TMPFILE: create by name, lock at once
            fd, named = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd), True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise _NoSpace(exc.errno, exc.strerror) from exc
            if not named:  # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
        except BaseException:
            if named:
                _unlink_quietly(os.path.join(directory, name))
            os.close(fd)
            raise
        return fd
    finally:
        os.close(dir_fd)


def open_held(path: str) -> int:
    """A read-write fd of the existing file ``path``, with a shared flock on it; FileNotFoundError
    when there is none (also when a sweep removed the name just before the lock was taken)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a sweeper's brief exclusive lock
        if not _same_file(fd, path):
            raise FileNotFoundError(errno.ENOENT, "removed while being opened", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_if_unheld(directory: str, name: str) -> bool:
    """Unlinks ``directory/name`` if no process holds it; whether it did."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone meanwhile, or not ours to open
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while anybody holds it
        # NOTES: while this exclusive lock is held nobody can take a shared one; the name must still be this file.
        if not _same_file(fd, path):
            return False
        os.unlink(path)
        return True
    except OSError:  # held (EWOULDBLOCK), no flock here, or removed meanwhile
        return False
    finally:
        os.close(fd)  # releases the exclusive lock


def _creator_pid(name: str) -> int:
    """The pid in a segment's name, or 0 (host counters' names carry none)."""
    pid = name[len(PREFIX):].split("_", 1)[0] if name.startswith(PREFIX) else ""
    return int(pid) if pid.isdigit() else 0


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited and let go of all its files and mappings: no such process,
    or a zombie with no other thread left (a zombie main thread waits for the others, which still
    hold the process's files and memory). Where /proc cannot be read: not alive."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except FileNotFoundError:
        return True
    except OSError:
        return not native().process_alive(pid)
    state = fields.get("State", "").split()[:1]
    threads = fields.get("Threads", "1").strip()
    return state in (["Z"], ["X"]) and (not threads.isdigit() or int(threads) <= 1)


def sweep_stale(directory: str = SEGMENT_DIR, *, exited: Iterable[int] = (), wait_s: float = 0.0) -> list[str]:
    """Unlinks the moe-comm files in ``directory`` (segments, host counters) that no process holds;
    returns their names. Local; never waits for a live holder.

    ``exited``: pids of host peers found exited or failing. Their segments are waited for, up to
    ``wait_s`` in all, until the process is gone (``process_gone``) and the segment unheld, so that
    a rank that sweeps right after a peer's failure, while the peer may still be dying, removes what
    the peer held. A segment is held by its creator alone, so this waits only for dying peers (or,
    for a peer that fails without dying, ``wait_s``)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    waited, deadline = set(exited), time.monotonic() + wait_s
    for name in names:
        if not name.startswith((PREFIX, COUNTERS_PREFIX)):
            continue
        pid = _creator_pid(name)
        while True:
            if _unlink_if_unheld(directory, name):
                removed.append(name)
                break
            if pid not in waited or time.monotonic() >= deadline or not os.path.exists(os.path.join(directory, name)):
                break
            time.sleep(0.005)  # a dying peer's last threads still hold it
    return removed
