"""What a rank's own GPU buffer offers beside its mapping, the same for ``IpcBuffers`` (CUDA IPC) and
``SymmetricBuffers`` (NVSHMEM): a byte range zeroed, bytes read back to the host, and no cap on an
up-front reservation (``SharedBuffers``' interface for the same three)."""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

import torch

__all__ = ["OwnDeviceBuffer"]


class OwnDeviceBuffer:
    """Mixed into a buffer class that sets ``_runtime`` (``moe_comm._cuda``: ``memset``, ``memcpy``,
    ``synchronize`` on raw pointers) and ``_guard`` (its GPU made current), and defines ``_own_span``."""

    _runtime: Any
    _guard: Callable[[], ContextManager[Any]]

    def _own_span(self) -> Optional[tuple[int, int]]:
        """(address, bytes) of this rank's buffer; None before the first ``ensure``."""
        raise NotImplementedError

    def zero_own(self, start: int = 0, end: Optional[int] = None, stream: int = 0) -> None:
        """Zeroes bytes [start, end) of this rank's buffer (to its end by default; its peers must not be
        writing to it), waiting until it is done."""
        span = self._own_span()
        if span is not None:
            base, nbytes = span
            stop = nbytes if end is None else end
            with self._guard():
                self._runtime.memset(base + start, 0, stop - start, stream)
                self._runtime.synchronize(stream)

    def own(self, offset: int, nbytes: int) -> torch.Tensor:
        """A copy (uint8 on the CPU) of ``nbytes`` of this rank's buffer at ``offset``, read once the
        launches queued before it on the default stream are done."""
        span = self._own_span()
        assert span is not None, "own(): no buffer mapped yet"
        out = torch.empty(nbytes, dtype=torch.uint8)
        with self._guard():
            self._runtime.memcpy(out.data_ptr(), span[0] + offset, nbytes, 0)
        return out

    @staticmethod
    def limit() -> Optional[int]:
        """The most bytes a buffer may be reserved with up front: GPU memory, no cap here (the
        allocation, cudaMalloc or NVSHMEM's heap, refuses clearly what does not fit)."""
        return None
