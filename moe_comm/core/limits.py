"""Size limits, checked before anything is allocated or sent.

Rows and experts are numbered with int32 in handles (``recv_src_idx``, ``send_head``, ``src_info``)
and records (source index, local expert), and a low-latency block is ``begin << 32 | count``; an
output must also fit in the memory of the device it lands on. Each check raises ValueError naming
the argument, the limit and the value, so a size like ``2**40`` is a clear error on the rank that
passed it (and, through the call's handshake, on every rank), never an allocator's.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .errors import bad_argument

__all__ = ["MAX_INT32", "check_count", "check_fits", "device_bytes"]

MAX_INT32 = 2**31 - 1


def check_count(op: str, name: str, value: int, why: str, limit: int = MAX_INT32) -> None:
    """``value`` (already an int) is at most ``limit``; ``why`` says what numbers it."""
    if value > limit:
        bad_argument(op, name, f"at most {limit} ({why})", value)


def device_bytes(device: torch.device) -> Optional[int]:
    """Memory of ``device`` in bytes (CPU: this host's physical memory), or None when unknown."""
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_fits(op: str, name: str, value: int, nbytes: int, device: torch.device, what: str) -> None:
    """The outputs that ``name=value`` sizes (``what``, ``nbytes`` in all) fit in ``device``'s memory."""
    limit = device_bytes(device)
    if limit is not None and nbytes > limit:
        bad_argument(op, name, f"small enough for {what} to fit on {device} ({nbytes} bytes needed, "
                     f"{limit} there)", value)
