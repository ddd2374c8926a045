"""The cuda_host backend's communication stream: host launches run in order on a background thread,
so a call returns while its kernel still moves bytes (``async_finish=True``), as a CUDA launch does.

``submit(op, launch)`` first waits for the previous launch (stream order), raising its error if
nobody has seen it yet, then starts ``launch`` (a kernel call that releases the GIL and returns its
error record). ``Job.wait()`` joins it and raises the record's error.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

__all__ = ["HostStream", "Job"]

Check = Callable[[str, Any], None]


class Job:
    """One launch on a ``HostStream``: on its own thread, or (``threaded=False``) run at once on the
    caller's, where a launch that fails to start raises from here."""

    def __init__(self, op: str, launch: Callable[[], Any], check: Check, threaded: bool = True) -> None:
        self.op, self._check = op, check
        self._record: Any = None
        self._failure: Optional[BaseException] = None
        self._seen = False
        self._thread: Optional[threading.Thread] = None
        if not threaded:
            self._record = launch()
            return
        self._thread = threading.Thread(target=self._run, args=(launch,), name=f"moe_comm cuda_host {op}",
                                        daemon=True)
        self._thread.start()

    def _run(self, launch: Callable[[], Any]) -> None:
        try:
            self._record = launch()
        except BaseException as exc:  # raised again by wait()
            self._failure = exc

    def wait(self) -> None:
        """Joins the launch; raises its failure (once, to the first caller that waits)."""
        if self._thread is not None:
            self._thread.join()
        if self._seen:
            return
        self._seen = True
        if self._failure is not None:
            raise self._failure
        self._check(self.op, self._record)


class HostStream:
    """Launches of one buffer, in order."""

    #: whether launches run on their own thread (the host build) or at once (see ``DeviceStream``)
    threaded = True

    def __init__(self, check: Check) -> None:
        self._check = check
        self._last: Optional[Job] = None

    def submit(self, op: str, launch: Callable[[], Any]) -> Job:
        self._wait_last()  # stream order: only the previous launch, never a device-wide wait
        self._last = Job(op, launch, self._check, self.threaded)
        return self._last

    def run(self, op: str, launch: Callable[[], Any]) -> None:
        """A launch the caller waits for (what needs its results on the host: notify, a receive)."""
        self.submit(op, launch).wait()

    def synchronize(self) -> None:
        """Waits for the last launch; raises its error if nobody has seen it."""
        self._wait_last()

    def _wait_last(self) -> None:
        if self._last is not None:
            self._last.wait()
