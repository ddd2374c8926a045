"""State a backend keeps for each low-latency dispatch until its combine: held by the handle's
``src_info`` tensor, weakly (the caller owns the handle; the state goes with it). The ascend backend
keeps MC2's opaque bookkeeping there, the cambricon backend its all-to-all's receive layout."""
from __future__ import annotations

import weakref
from typing import Generic, TypeVar

from ...protocol.handle import LowLatencyHandle

__all__ = ["PerHandle"]

T = TypeVar("T")


class PerHandle(Generic[T]):
    """One value per live handle. A handle rebuilt from DeepEP's tuple finds it (same ``src_info``)."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[weakref.ref, T]] = {}

    def remember(self, handle: LowLatencyHandle, value: T) -> None:
        key = id(handle.src_info)
        self._held[key] = (weakref.ref(handle.src_info, lambda _: self._held.pop(key, None)), value)

    def get(self, op: str, handle: LowLatencyHandle, why: str) -> T:
        """The value of ``handle``; ValueError unless this Buffer's dispatch returned it (``why``: what the
        value is needed for)."""
        held = self._held.get(id(handle.src_info))
        if held is None or held[0]() is not handle.src_info:
            raise ValueError(f"{op}: handle must be one that this Buffer's low_latency_dispatch returned: {why}, "
                             f"which the handle's tensors do not hold")
        return held[1]
