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

from typing import Any, Callable, Optional

__all__ = ["DeviceStream", "FinishedJob"]

Check = Callable[[str, Any], None]


class FinishedJob:
    """A launch that has returned ``record`` (None, or an error record for ``check``)."""

    def __init__(self, op: str, record: Any, check: Check) -> None:
        self.op, self._record, self._check = op, record, check
        self._seen = False

    def wait(self) -> None:
        """Raises the record's error, once."""
        if self._seen:
            return
        self._seen = True
        self._check(self.op, self._record)


class DeviceStream:
    """Launches of one buffer in order; ``comm``: its ``CommStream`` (``synchronize()`` waits for it)."""

    def __init__(self, check: Check, comm: Any) -> None:
        self._check, self.comm = check, comm
        self._last: Optional[FinishedJob] = None

    def submit(self, op: str, launch: Callable[[], Any]) -> FinishedJob:
        if self._last is not None:
            last, self._last = self._last, None
            last.wait()
        self._last = FinishedJob(op, launch(), self._check)
        return self._last

    def run(self, op: str, launch: Callable[[], Any]) -> None:
        """A launch the caller waits for (what needs its results on the host: notify, a receive)."""
        self.submit(op, launch).wait()

    def synchronize(self) -> None:
        """Waits for everything on the comm stream; raises the last launch's error if nobody has seen it."""
        self.comm.synchronize()
        if self._last is not None:
            self._last.wait()
