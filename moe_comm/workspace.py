"""Byte buffers reused across calls: the CPU twin of DeepEP's preallocated communication buffers.

Large exchanges would otherwise allocate fresh memory on every call; above glibc's mmap threshold
that memory is mapped anew and page-faulted on first touch, which measured up to 4x slower than the
copy itself (bench/RESULTS.md). A buffer is lent out by ``take`` and comes back with ``give_back``;
while one is out (an asynchronous operation in flight), the next ``take`` allocates a new one, so
two operations never share bytes.
"""
from __future__ import annotations

import torch

__all__ = ["Workspace"]


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
