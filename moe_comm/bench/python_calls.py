"""The Python calls an operation makes on the host: what a call costs before its bytes move (issue 46's measure,
printed by the low-latency and normal benchmarks)."""
from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["counted"]


def counted(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the Python function calls it made on this thread (``sys.setprofile`` call events; native
    calls and other threads' calls are not counted). Pass a ``functools.partial``: a lambda would be one more."""
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls
