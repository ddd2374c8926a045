"""Memory reused across calls, so that large tensors do not pay for page faults every call.

Large fresh allocations are mapped anew by the C library and page-faulted on first touch, which
measured 8x slower than copying into memory already touched (1.2 vs 10.4 GB/s for 117 MB on this
project's CPU machine). Three remedies:

* ``zeros``: large zero outputs of which a call writes a small part (the grouped GEMM's rows outside
  every expert). ``numpy.zeros`` gets large blocks from calloc as fresh, already-zero pages, so only the
  pages written cost anything (``torch.zeros`` touches every page) -- until glibc's mmap threshold has
  grown past the block's size, when calloc serves it from the heap and zeroes all of it (measured
  0.2-0.5 ms for a low-latency dispatch's 7.3 MB outputs, bench/RESULTS.md; those now come from
  ``empty`` and their receive zeroes only the padding).
* ``empty``: the CPU twin of torch's CUDA caching allocator. A tensor of at least 1 MiB is built on
  a block from a pool; when the last reference to it dies, its block returns to the pool, already
  faulted in, for the next output of that size class. At most ``MOE_COMM_POOL_BYTES`` (default
  2 GiB) of idle blocks are kept.
* ``Workspace``: the byte buffers a transport exchanges through (the CPU twin of DeepEP's
  preallocated communication buffers). A buffer is lent out by ``take`` and comes back with
  ``give_back``; while one is out (an asynchronous operation in flight), the next ``take``
  allocates a new one, so two operations never share bytes.
"""
from __future__ import annotations

import collections
import math
import threading
import weakref

import numpy as np
import torch

from . import env

__all__ = ["zeros", "empty", "pool_stats", "Workspace"]

_MIN_POOLED = 1 << 20
_CLASS = 2 << 20  # size classes: multiples of 2 MiB


class _Pool:
    """Idle blocks by size class, oldest first; thread-safe (blocks come back on any thread)."""

    def __init__(self) -> None:
        self._idle: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def take(self, nbytes: int) -> np.ndarray:
        size = -(-nbytes // _CLASS) * _CLASS
        with self._lock:
            blocks = self._idle.get(size)
            if blocks:
                self.hits += 1
                self._idle_bytes -= size
                return blocks.pop()
            self.misses += 1
        return np.empty(size, dtype=np.uint8)

    def give_back(self, block: np.ndarray) -> None:
        limit = env.pool_bytes()
        with self._lock:
            self._idle.setdefault(block.size, []).append(block)
            self._idle.move_to_end(block.size)
            self._idle_bytes += block.size
            while self._idle_bytes > limit and self._idle:
                size, blocks = next(iter(self._idle.items()))
                blocks.pop(0)
                self._idle_bytes -= size
                if not blocks:
                    del self._idle[size]


_POOL = _Pool()


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous tensor with garbage contents; on CPU, from recycled memory when large."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < _MIN_POOLED:
        return torch.empty(shape, dtype=dtype, device=device)
    block = _POOL.take(nbytes)
    view = block[:nbytes]
    # The tensor's storage holds `view`; when the storage dies, so does `view`, and the block returns.
    # Not at interpreter exit: nothing will take it then.
    weakref.finalize(view, _POOL.give_back, block).atexit = False
    return torch.from_numpy(view).view(dtype).view(shape)


def pool_stats() -> dict[str, int]:
    """Pool counters: ``hits`` and ``misses`` of ``empty`` since start, ``idle_bytes`` now."""
    return {"hits": _POOL.hits, "misses": _POOL.misses, "idle_bytes": _POOL._idle_bytes}


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous zero tensor; on CPU its untouched pages are never written."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:  # (numpy's empty array has stride 0, which cannot be viewed)
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class Workspace:
    """Grow-only byte buffers keyed by name and device."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, torch.device], torch.Tensor] = {}

    def take(self, name: str, rows: int, row_bytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (storage to give back, a `[rows, row_bytes]` uint8 view of it). Contents are garbage."""
        nbytes = rows * row_bytes
        storage = self._idle.pop((name, device), None)
        if storage is None or storage.numel() < nbytes:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return storage, storage[:nbytes].view(rows, row_bytes)

    def give_back(self, name: str, storage: torch.Tensor) -> None:
        """Returns a buffer from ``take``; the larger of two returned buffers is kept."""
        key = (name, storage.device)
        idle = self._idle.get(key)
        if idle is None or idle.numel() < storage.numel():
            self._idle[key] = storage

    def clear(self) -> None:
        self._idle.clear()
