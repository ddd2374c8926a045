"""The cuda_host backend's communication stream: host launches run in order on one background thread
of the stream, so a call returns while its kernel still moves bytes (``async_finish=True``), as a CUDA
launch does, and no launch pays for starting a thread.

``submit(op, launch)`` first waits for the previous launch (stream order), raising its error if
nobody has seen it yet, then hands ``launch`` (a kernel call that releases the GIL and returns its
error record) to the stream's thread. ``Job.wait()`` waits for it and raises the record's error.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

__all__ = ["HostStream", "Job"]

Check = Callable[[str, Any], None]


class Job:
    """One launch on a ``HostStream``: run by the stream's thread (``worker``), or by the first caller that
    waits for it before that thread has started it (a blocking call then pays no thread wake-up), or,
    without a worker, at once on the caller's thread, where a launch that fails to start raises from here."""

    def __init__(self, op: str, launch: Callable[[], Any], check: Check,
                 worker: Optional["queue.SimpleQueue[Optional[Job]]"] = None) -> None:
        self.op, self._check = op, check
        self._record: Any = None
        self._failure: Optional[BaseException] = None
        self._seen = False
        self._done = threading.Event()
        self._claimed = threading.Lock()  # held by whoever runs the launch: the stream's thread or a waiter
        self._launch: Optional[Callable[[], Any]] = launch
        if worker is None:
            self._claimed.acquire()
            self._launch = None
            self._record = launch()
            self._done.set()
            return
        worker.put(self)

    def run(self) -> None:
        """The launch, unless a waiter has run it already."""
        if not self._claimed.acquire(blocking=False):
            return
        try:
            self._record = self._launch()
        except BaseException as exc:  # raised again by wait()
            self._failure = exc
        finally:
            self._launch = None
            self._done.set()

    def wait(self) -> None:
        """Waits for the launch (running it here if the stream's thread has not started it: the stream
        holds one launch at a time, so the order is kept); raises its failure (once, to the first caller
        that waits)."""
        self.run()
        self._done.wait()
        if self._seen:
            return
        self._seen = True
        if self._failure is not None:
            raise self._failure
        self._check(self.op, self._record)


def _serve(jobs: "queue.SimpleQueue[Optional[Job]]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()


class HostStream:
    """Launches of one buffer, in order."""

    #: whether launches run on their own thread (the host build) or at once (see ``DeviceStream``)
    threaded = True

    def __init__(self, check: Check) -> None:
        self._check = check
        self._last: Optional[Job] = None
        self._jobs: Optional["queue.SimpleQueue[Optional[Job]]"] = None  # the thread's, once started

    def submit(self, op: str, launch: Callable[[], Any]) -> Job:
        self._wait_last()  # stream order: only the previous launch, never a device-wide wait
        if self.threaded and self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), name="moe_comm cuda_host stream", daemon=True).start()
        self._last = Job(op, launch, self._check, self._jobs)
        return self._last

    def close(self) -> None:
        """Ends the stream's thread once its launches are done. Idempotent."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    def run(self, op: str, launch: Callable[[], Any]) -> None:
        """A launch the caller waits for (what needs its results on the host: notify, a receive)."""
        self.submit(op, launch).wait()

    def synchronize(self) -> None:
        """Waits for the last launch; raises its error if nobody has seen it."""
        self._wait_last()

    def _wait_last(self) -> None:
        if self._last is not None:
            self._last.wait()
