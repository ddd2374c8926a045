"""fp32 copies of CPU expert weights for the native grouped GEMM, kept across calls.

The native CPU GEMM multiplies in fp32 where it must (the SwiGLU epilogue reads fp32 products, and FP8
weights are dequantized first). Converting every expert's weights on every call is a fixed cost per
call, which a layer running several micro-batches pays several times; at decode with FP8 experts it was
most of the layer's time. A converted copy is kept while its weight tensor lives and is not modified in
place (torch's version counter; the scales likewise), up to ``MOE_COMM_WEIGHT_CACHE_BYTES`` in all
(default 1 GiB, 0 turns it off), least recently used first out.
"""
from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..core import env

__all__ = ["fp32_weights", "cache_stats", "clear"]


@dataclass
class _Entry:
    weights: "weakref.ref[torch.Tensor]"
    scales: Optional["weakref.ref[torch.Tensor]"]
    versions: tuple[int, int]
    value: torch.Tensor


# NOTES: reentrant: a weight tensor collected (by the cyclic GC) inside a locked region runs _forget there
_lock = threading.RLock()
_entries: "collections.OrderedDict[int, _Entry]" = collections.OrderedDict()
_stats = {"hits": 0, "misses": 0, "bytes": 0}


def _versions(b: torch.Tensor, scales: Optional[torch.Tensor]) -> tuple[int, int]:
    return b._version, -1 if scales is None else scales._version


def _forget(key: int) -> None:
    with _lock:
        entry = _entries.pop(key, None)
        if entry is not None:
            _stats["bytes"] -= entry.value.nbytes


def fp32_weights(b: torch.Tensor, scales: Optional[torch.Tensor],
                 convert: Callable[[], torch.Tensor]) -> Optional[torch.Tensor]:
    """The fp32 copy ``convert()`` makes of CPU weights ``b`` (with their ``scales``, or None), from the
    cache when ``b`` and ``scales`` are the same tensors, unmodified since; None when it does not fit
    (the caller converts what it needs itself)."""
    nbytes = b.numel() * 4
    if b.device.type != "cpu" or nbytes > env.weight_cache_bytes():
        return None
    key, versions = id(b), _versions(b, scales)
    with _lock:
        entry = _entries.get(key)
        if entry is not None and entry.weights() is b and entry.versions == versions and \
                (entry.scales() if entry.scales is not None else None) is scales:
            _entries.move_to_end(key)
            _stats["hits"] += 1
            return entry.value
    value = convert()
    with _lock:
        _stats["misses"] += 1
        old = _entries.pop(key, None)
        if old is not None:
            _stats["bytes"] -= old.value.nbytes
        while _entries and _stats["bytes"] + value.nbytes > env.weight_cache_bytes():
            _stats["bytes"] -= _entries.popitem(last=False)[1].value.nbytes
        _entries[key] = _Entry(weakref.ref(b, lambda _, key=key: _forget(key)),
                               None if scales is None else weakref.ref(scales), versions, value)
        _stats["bytes"] += value.nbytes
    return value


def cache_stats() -> dict[str, int]:
    """Hits, misses, bytes held and entries of the cache (for tests and benchmarks)."""
    with _lock:
        return {**_stats, "entries": len(_entries)}


def clear() -> None:
    """Drops every cached copy."""
    with _lock:
        _entries.clear()
        _stats["bytes"] = 0
