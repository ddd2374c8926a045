"""Busy loops beside a test: the load of a shared CI machine (every wait's deadline and every thread
hand-off runs later than on an idle one)."""
from __future__ import annotations

import contextlib
import subprocess
from typing import Iterator


@contextlib.contextmanager
def busy_loops(count: int = 2) -> Iterator[None]:
    """``count`` processes spinning on a core each, for the length of the block."""
    loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
