"""Joining the process group that a launcher (torchrun, mpirun) started this process in.

``init_from_env`` reads, in order: torchrun's ``RANK``/``WORLD_SIZE``, MPICH/Hydra's
``PMI_RANK``/``PMI_SIZE``, Open MPI's ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``; the rendezvous
is ``MASTER_ADDR`` (default 127.0.0.1) : ``MASTER_PORT`` (default 29500).
"""
from __future__ import annotations

import atexit
import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["init_from_env", "launcher_rank"]

_LAUNCHER_VARS = (("RANK", "WORLD_SIZE", "torchrun"), ("PMI_RANK", "PMI_SIZE", "mpirun (MPICH/Hydra)"),
                  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"))


def launcher_rank() -> Optional[tuple[int, int, str]]:
    """``(rank, world_size, launcher)`` from the environment, or None outside a launcher."""
    for rank_var, size_var, launcher in _LAUNCHER_VARS:
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var]), launcher
    return None


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Initialises the default process group from the launcher's environment (if not yet done);
    returns the WORLD group. A group created here is destroyed at interpreter exit.

    Raises RuntimeError, naming the variables looked for, when no launcher set them.
    """
    found = launcher_rank()
    if found is None:
        names = ", ".join(f"{r}/{s}" for r, s, _ in _LAUNCHER_VARS)
        raise RuntimeError(f"init_from_env: no launcher environment found (looked for {names}); "
                           f"start with torchrun or mpirun, or use moe_comm.spawn")
    rank, world_size, _ = found
    if not dist.is_initialized():
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT", "29500")
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # NOTES: a gloo group still alive at interpreter exit can abort the process ("terminate
        # called without an active exception"); the group created here is torn down first.
        atexit.register(_leave_group, torch.zeros(1, device="cuda" if backend == "nccl" else "cpu"))
    return dist.group.WORLD


_EXIT_BARRIER_S = 30.0
# Exit-barrier tensors and works. NOTES: module state on purpose: they must outlive the atexit
# registry and the interpreter's first shutdown collection (see _leave_group).
_EXIT_KEEP: list[Any] = []


def _leave_group(token: torch.Tensor) -> None:
    """Destroys the default group once every rank is done with it: rank 0 hosts the rendezvous
    store, and leaving before the others would break their teardown. A rank that is not heard from
    within the deadline is not waited for.

    The exit barrier is an all-reduce of ``token`` whose work ``_EXIT_KEEP`` keeps referenced until
    the modules are torn down: gloo's worker thread releases a finished work shortly after the
    waiter wakes up, and if that were the last reference it would free the work's tensors, which
    takes the GIL and aborts the process during interpreter shutdown.
    """
    if not dist.is_initialized():
        return
    try:
        work = dist.all_reduce(token, async_op=True)
        _EXIT_KEEP.append(work)
        work.wait(timeout=datetime.timedelta(seconds=_EXIT_BARRIER_S))
    except RuntimeError:
        return  # a peer is gone or late: exit without the collective teardown
    dist.destroy_process_group()
