"""The ranks of a ``LocalWorld`` as processes of this host started by this one (multiprocessing's
``forkserver``: forked from a server process that has imported torch and moe_comm already)."""
from __future__ import annotations

import multiprocessing
import os
import queue
import sys
from typing import Any, Optional

import torch.multiprocessing as mp

from .worker import worker_loop

__all__ = ["SpawnedRanks"]

# NOTES: a fresh interpreter takes seconds to import torch; a rank forked from the forkserver, which
# imported these once, starts in milliseconds. The server starts with this process's first world and
# imports nothing else (no CUDA, no thread pool is started by an import), so a fork of it is as clean as
# a spawned interpreter; each rank then takes this process's environment as it is at the world's start,
# as a spawned one would (the server's is the one of its own start).
_PRELOAD = ["torch", "torch.distributed", "moe_comm"]


#: How long a rank asked to leave may take to exit before it is killed.
_LEAVE_S = 20.0

#: How often an idle rank checks that the process that started its world still runs.
_OWNER_POLL_S = 1.0


class _TasksWhileOwnerLives:
    """A rank's task queue, read while the process that started the world lives; once that process has
    gone (killed by a CI timeout, say) ``get`` returns None, the rank's signal to leave.

    Without this an orphaned rank would wait for ever: it holds its queue's write end, and the
    forkserver's liveness pipe, so neither ever reports the end."""

    def __init__(self, tasks: Any) -> None:
        self._tasks = tasks
        self._owner = multiprocessing.parent_process()

    def get(self) -> Any:
        while True:
            try:
                return self._tasks.get(timeout=_OWNER_POLL_S)
            except queue.Empty:
                if self._owner is not None and not self._owner.is_alive():
                    return None


def _forked_rank(environ: dict[str, str], rank: int, world_size: int, store_port: int, backend: str,
                 timeout_s: float, threads: int, rank_environ: dict[str, str], tasks: Any, results: Any) -> None:
    """``worker_loop`` in a rank forked from the server, with the starting process's environment."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        worker_loop(rank, world_size, store_port, backend, timeout_s, threads, rank_environ,
                    _TasksWhileOwnerLives(tasks), results)
    finally:
        _finalize_mpi()


def _finalize_mpi() -> None:
    """``MPI_Finalize`` where this rank initialised MPI (a rank that imported mpi4py is an MPI singleton).

    mpi4py finalises when the interpreter exits; a forked rank leaves by ``os._exit``, which skips that,
    and MPICH keeps its segment's name in /dev/shm until ``MPI_Finalize``."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


class SpawnedRanks:
    """``world_size`` child processes running ``worker_loop`` (a ``worker.Ranks``), fed by queues."""

    def __init__(self, world_size: int, store_port: int, backend: str, timeout_s: float, threads: int,
                 environ: dict[str, str]) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: this process's first world
        here = dict(os.environ)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_forked_rank, args=(here, r, world_size, store_port, backend, timeout_s,
                                                              threads, environ, self._tasks[r], self._results),
                                   daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def send(self, rank: int, task: Any) -> None:
        self._tasks[rank].put(task)

    def receive(self, timeout_s: float) -> Optional[tuple[int, bool, Any]]:
        try:
            return self._results.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def alive(self, rank: int) -> bool:
        return self._procs[rank].is_alive()

    def stop(self, force: bool) -> None:
        for rank in range(len(self._procs)):
            self.send(rank, None)
        for p in self._procs:
            # A rank that ran torch.compile takes 5-7 s to exit (measured on 2 cores); killed, it would skip
            # multiprocessing's finalizers and leave its named semaphores (tqdm's lock, with tqdm installed)
            # in /dev/shm.
            p.join(timeout=0 if force else _LEAVE_S)
            if p.is_alive():
                p.kill()
                p.join()
        # NOTES: every queue holds named semaphores (/dev/shm/sem.mp-*) until it is collected; let
        # them go with the ranks rather than with this object.
        for q in [self._results, *self._tasks]:
            q.cancel_join_thread()
            q.close()
        self._results, self._tasks = None, []
