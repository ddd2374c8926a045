"""Rank functions for test_shm_hygiene: a rank SIGKILLed while its transport sets up files in /dev/shm.

Each kill point is a fault injected around the real method, in the victim only: it first writes the
path of the file it is about to leave (``<stamps>/left``), then SIGKILLs itself.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.transport import host_counters, shm, shm_segment
from moe_comm.transport.mpi import mapped_mpich_segments

from helpers.shm_cases import _inputs

#: Where ``killed_while_setting_up`` can kill the victim, by transport. shm: in the middle of a
#: growth (``ShmTransport._map``), after creating its new segment, after the names are exchanged,
#: after mapping its peers' (before the barrier), after the barrier (before the unlink). Every
#: transport with host counters (the shm transport through its collective one): after opening the
#: counters file, before the construction's barrier.
KILL_POINTS = {"shm": ["created", "named", "mapped", "met", "counters"], "mpi": ["counters"],
               "collective": ["counters"]}


def identity(group: dist.ProcessGroup) -> dict[str, Any]:
    """This rank's pid and the MPICH segments it maps (none outside an MPI job)."""
    return dict(pid=os.getpid(), mpich=mapped_mpich_segments())


def _die(stamps: str, left: str) -> None:
    with open(os.path.join(stamps, f"left.{os.getpid()}"), "w") as f:
        f.write(left)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, stamps: str) -> None:
    """Patches the method after which ``point`` lies so that this process dies there."""
    segment = shm_segment.Segment

    def after(cls: Any, method: str, kill: Callable[..., bool]) -> None:
        real = getattr(cls, method)

        def wrapped(*args: Any, **kw: Any) -> Any:
            result = real(*args, **kw)
            left = kill(args, kw, result)
            if left:
                _die(stamps, left)
            return result

        setattr(cls, method, wrapped)

    mine: list[str] = []  # the segment being grown
    after(segment, "create", lambda a, kw, seg: mine.append(seg.name) or (point == "created" and seg.name))
    after(shm.ShmTransport, "_gather_names", lambda a, kw, names: point == "named" and mine[-1])
    after(shm.CollectiveTransport, "barrier",
          lambda a, kw, _: point == "met" and kw.get("op", "").startswith("shm transport") and mine[-1])
    if point == "mapped":  # before the barrier: after the last peer's segment is opened
        real_barrier = shm.CollectiveTransport.barrier

        def barrier(self: Any, *, op: str) -> None:
            if op.startswith("shm transport"):
                _die(stamps, mine[-1])
            real_barrier(self, op=op)

        shm.CollectiveTransport.barrier = barrier
    after(host_counters.HostCounters, "__init__", lambda a, kw, _: point == "counters" and a[0].path)


def killed_while_setting_up(group: dist.ProcessGroup, victims: list[int], point: str, stamps: str) -> Any:
    """``victims`` die at ``point``: in the buffer's construction (host counters) or in the growth
    of its slots that the first dispatch needs (shm). Survivors return their exception (type,
    message); ranks whose transport never reaches ``point`` return "not reached"."""
    rank = dist.get_rank(group)
    if rank in victims and point == "counters":
        _arm(point, stamps)
    try:
        buf = moe_comm.Buffer(group, timeout_s=20, explicitly_destroy=True)
        if rank in victims and point != "counters":
            _arm(point, stamps)
        x, idx, w = _inputs(rank, 300, 2048, 12, 3)  # ~2.4 MiB per rank: 1 MiB slots grow
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12)
    except Exception as exc:  # the test checks which
        return type(exc).__name__, str(exc)
    buf.destroy()
    return "not reached"


def killed_at_random(group: dist.ProcessGroup, victim: int, seed: int, stamps: str) -> Any:
    """Buffers are built and grown in a loop; ``victim`` is SIGKILLed by a timer at a random moment
    (of the first ~1.5 s). Survivors return their exception type."""
    rank = dist.get_rank(group)
    if rank == victim:
        delay = random.Random(seed).uniform(0.0, 1.5)
        threading.Timer(delay, _die, (stamps, "random")).start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            buf = moe_comm.Buffer(group, transport="shm", timeout_s=20, explicitly_destroy=True)
            for tokens in (150, 300, 600):  # 1.2, 2.4, 4.8 MiB per rank: two growths
                x, idx, w = _inputs(rank, tokens, 2048, 12, 3)
                buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12)
            buf.destroy()
    except Exception as exc:  # the test checks which
        return type(exc).__name__
    return "no exception"


def kill_rank(group: dist.ProcessGroup, victim: int) -> str:
    """``victim`` SIGKILLs itself; the others wait a little and return."""
    if dist.get_rank(group) == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return "alive"


def mpich_job_shm() -> list[str]:
    """The MPICH segments this process maps (for the bare mpiexec job of test_shm_hygiene)."""
    return mapped_mpich_segments()


def hold_counters(token: str, count: int) -> torch.Tensor:
    """Opens host counters ``token`` like a rank and keeps them (the caller kills the process)."""
    return host_counters.HostCounters(token, count, 0).entered
