"""Tensor addresses for a kernel launch, with the tensors kept alive for it."""
from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

__all__ = ["Pins"]

T = TypeVar("T")


class Pins:
    """``pin(t)`` is ``t.data_ptr()`` (0 for None), and ``t`` lives as long as ``pin``: a temporary
    (``x.contiguous()``, ``idx.to(torch.int64)``) would otherwise be freed the moment its address was
    taken, before the launch reads it."""

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []

    def __call__(self, t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        self._held.append(t)
        return t.data_ptr()

    def launch(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: a launch on these addresses. A deferred launch calls it through this object,
        so the closure that makes it keeps the tensors alive."""
        return fn(*args)
