"""Waits on processes the tests ended (or whose owner they ended), with a deadline; and says what processes
that ran past a deadline were doing."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from helpers.deadlines import EXIT_S


def all_gone(pids: list[int], within_s: float = EXIT_S) -> bool:
    """Whether every process of ``pids`` has exited (a zombie counts as exited) within ``within_s``."""
    from moe_comm.core.native import native
    deadline = time.monotonic() + within_s
    while any(native().process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(native().process_alive(p) for p in pids)


def _stat(pid: str) -> Optional[list[str]]:
    """Fields of /proc/<pid>/stat after the command name (field 3 on: state, ppid, pgrp, session, ...)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _read(path: str, limit: int = 120) -> str:
    try:
        return Path(path).read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError as e:
        return f"({e.strerror})"


def _cpu_ticks() -> dict[str, int]:
    ticks = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None:
            ticks[entry.name] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


def _thread_waits(pid: str) -> str:
    """How many of the process's threads are in each state and kernel wait channel."""
    counts: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return "gone"
    for tid in tids:
        fields = _stat(f"{pid}/task/{tid}")
        key = f"{fields[0] if fields else '?'} {_read(f'/proc/{pid}/task/{tid}/wchan', 40)}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in sorted(counts.items()))


def describe_sessions(leaders: list[int], sample_s: float = 1.0) -> str:
    """What the processes of the sessions led by ``leaders`` (``start_new_session=True`` children) are doing,
    for a test whose ranks ran past their deadline: each one's state (R running, S sleeping, D in I/O,
    T stopped), the CPU it used in ``sample_s`` and in all, its kernel wait channel and command line; then
    the machine's load and its busiest processes over the same interval. Never raises."""
    hz = os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks()
    time.sleep(sample_s)
    after = _cpu_ticks()
    lines = [f"load average: {_read('/proc/loadavg')}"]
    sessions = {str(pid) for pid in leaders}
    for pid in sorted(after, key=int):
        fields = _stat(pid)
        if fields is None or fields[3] not in sessions:
            continue
        used = (after[pid] - before.get(pid, after[pid])) / hz
        lines.append(f"pid {pid} session {fields[3]} state {fields[0]} threads {fields[17]} "
                     f"cpu {used:.2f}s of {sample_s:g}s ({after[pid] / hz:.1f}s in all) major faults {fields[9]} "
                     f"wchan {_read(f'/proc/{pid}/wchan')} (threads: {_thread_waits(pid)}): "
                     f"{_read(f'/proc/{pid}/cmdline')}")
    busiest = sorted(after, key=lambda p: before.get(p, after[p]) - after[p])[:5]
    lines.append("busiest: " + "; ".join(f"{p} {(after[p] - before.get(p, after[p])) / hz:.2f}s "
                                          f"{_read(f'/proc/{p}/cmdline', 60)}" for p in busiest))
    return "\n".join(lines)
