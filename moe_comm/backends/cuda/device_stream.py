"""The cuda backend's stream of launches, with ``HostStream``'s interface (``host_stream.py``) over
the device build's launches (``device_kernels.DeviceKernels``), which order themselves on the CUDA comm
stream.

``submit(op, launch)`` runs ``launch`` at once, on the caller's thread: a normal-mode launch returns
when its kernel has finished (the device build synchronises them), a low-latency send as soon as it is
enqueued, a low-latency receive once it has finished. It returns a finished ``Job`` whose ``wait()``
raises the launch's error record (once, to the first caller that waits); a launch that fails to start
raises from ``submit`` itself. As on the host stream, a record nobody has seen yet is raised by the next
``submit`` or ``synchronize`` first.

Tested here with fakes only: nothing of this has run on a GPU.
"""
from __future__ import annotations

from typing import Any

from .host_stream import Check, HostStream

__all__ = ["DeviceStream"]


class DeviceStream(HostStream):
    """Launches of one buffer in order, each at once on the caller's thread; ``comm``: its
    ``CommStream`` (``synchronize()`` waits for it too)."""

    threaded = False

    def __init__(self, check: Check, comm: Any) -> None:
        super().__init__(check)
        self.comm = comm

    def synchronize(self) -> None:
        """Waits for everything on the comm stream; raises the last launch's error if nobody has seen it."""
        self.comm.synchronize()
        super().synchronize()
