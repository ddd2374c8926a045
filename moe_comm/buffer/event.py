"""``EventHandle`` and ``EventOverlap``: DeepEP's completion objects, for every device.

On CUDA an ``EventHandle`` wraps a recorded ``torch.cuda.Event``. On devices without streams (CPU)
it wraps the work still to be done to finish an asynchronous operation: waiting on it finishes the
exchange (with the operation's deadline) and fills the tensors the operation returned. In both
cases ``current_stream_wait()`` makes those tensors ready for the caller's next step.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

__all__ = ["EventHandle", "EventOverlap", "NO_EVENT"]


class EventHandle:
    """A point in the work of the current stream (CUDA) or a pending completion (CPU and others).

    ``EventHandle()`` records an event on the current CUDA stream when CUDA is initialised, and is
    otherwise already complete. Internally, ``EventHandle(finish=fn)`` runs ``fn`` once, on the
    first ``current_stream_wait()``; an exception from ``fn`` is re-raised by every later wait.
    """

    def __init__(self, finish: Optional[Callable[[], None]] = None) -> None:
        self._finish = finish
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._cuda_event = None
        if finish is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda_event = torch.cuda.Event()
            self._cuda_event.record()

    @property
    def is_pending(self) -> bool:
        """True while an asynchronous operation behind this handle has not been finished."""
        return self._finish is not None

    def current_stream_wait(self) -> None:
        """Makes the caller's current stream (or, on CPU, the caller) wait until this point is reached."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._finish is not None:
                finish, self._finish = self._finish, None
                try:
                    finish()
                except BaseException as exc:
                    self._error = exc
                    raise
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)


class EventOverlap:
    """DeepEP's ``EventOverlap``: an optional ``EventHandle`` plus tensors to keep alive until waited.

    Valid (``event is not None``) only for operations called with ``async_finish=True`` and for
    ``Buffer.capture()``. ``with event: compute()`` runs ``compute`` and then waits, so the compute
    overlaps the communication.
    """

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Waits on the event; raises RuntimeError on an empty ``EventOverlap`` (as DeepEP asserts)."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: this EventOverlap holds no event "
                               "(the operation was not called with async_finish=True)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


#: the event of a call made without ``async_finish``, shared by prepared calls (DeepEP's empty ``EventOverlap``:
#: it holds nothing, and waiting on it raises)
NO_EVENT = EventOverlap()
