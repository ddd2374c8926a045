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


def proc_stat(pid: object) -> Optional[list[str]]:
    """Fields of /proc/<pid>/stat after the command name (field 3 on: [0] state, [1] ppid, [2] pgrp,
    [3] session, ..., [9] major faults, [11] utime, [12] stime, [17] threads); None once it is gone.
    ``pid`` may be ``"<pid>/task/<tid>"`` for a thread."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def _read(path: str, limit: int = 120) -> str:
    try:
        return Path(path).read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError as e:
        return f"({e.strerror})"


def command_line(pid: str) -> str:
    """The process's command line, arguments joined by spaces (the read's error, in parentheses, once it is
    gone)."""
    return _read(f"/proc/{pid}/cmdline", 1000)


def running_processes() -> dict[str, list[str]]:
    """Every process's ``proc_stat``, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        fields = proc_stat(entry) if entry.isdigit() else None
        if fields is not None:
            found[entry] = fields
    return found


def _ticks(fields: list[str]) -> int:
    return int(fields[11]) + int(fields[12])  # utime + stime


def _thread_waits(pid: str) -> str:
    """How many of the process's threads are in each state and kernel wait channel."""
    counts: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return "gone"
    for tid in tids:
        fields = proc_stat(f"{pid}/task/{tid}")
        key = f"{fields[0] if fields else '?'} {_read(f'/proc/{pid}/task/{tid}/wchan', 40)}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {key}" for key, n in sorted(counts.items()))


def describe_sessions(leaders: list[int], sample_s: float = 1.0) -> str:
    """What the processes of the sessions led by ``leaders`` (``start_new_session=True`` children) are doing,
    for a test whose ranks ran past their deadline: each one's state (R running, S sleeping, D in I/O,
    T stopped), the CPU it used in ``sample_s`` and in all, its kernel wait channel and command line; then
    the machine's load and its busiest processes over the same interval. Never raises."""
    hz = os.sysconf("SC_CLK_TCK")
    before = running_processes()
    time.sleep(sample_s)
    after = running_processes()
    used = {pid: (_ticks(fields) - _ticks(before.get(pid, fields))) / hz for pid, fields in after.items()}
    lines = [f"load average: {_read('/proc/loadavg')}"]
    sessions = {str(pid) for pid in leaders}
    for pid in sorted(after, key=int):
        fields = after[pid]
        if fields[3] not in sessions:
            continue
        lines.append(f"pid {pid} session {fields[3]} state {fields[0]} threads {fields[17]} "
                     f"cpu {used[pid]:.2f}s of {sample_s:g}s ({_ticks(fields) / hz:.1f}s in all) "
                     f"major faults {fields[9]} wchan {_read(f'/proc/{pid}/wchan')} "
                     f"(threads: {_thread_waits(pid)}): {_read(f'/proc/{pid}/cmdline')}")
    busiest = sorted(used, key=lambda p: -used[p])[:5]
    lines.append("busiest: " + "; ".join(f"{p} {used[p]:.2f}s {_read(f'/proc/{p}/cmdline', 60)}" for p in busiest))
    return "\n".join(lines)
