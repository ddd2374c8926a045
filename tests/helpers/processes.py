"""Waits on processes the tests ended (or whose owner they ended), with a deadline."""
from __future__ import annotations

import time

from helpers.deadlines import EXIT_S


def all_gone(pids: list[int], within_s: float = EXIT_S) -> bool:
    """Whether every process of ``pids`` has exited (a zombie counts as exited) within ``within_s``."""
    from moe_comm.core.native import native
    deadline = time.monotonic() + within_s
    while any(native().process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(native().process_alive(p) for p in pids)
