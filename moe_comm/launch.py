"""Starting process groups: from a launcher's environment (torchrun, mpirun) or as local ranks.

``init_from_env`` reads, in order: torchrun's ``RANK``/``WORLD_SIZE``, MPICH/Hydra's
``PMI_RANK``/``PMI_SIZE``, Open MPI's ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``; the rendezvous
is ``MASTER_ADDR`` (default 127.0.0.1) : ``MASTER_PORT`` (default 29500).
``LocalWorld`` / ``spawn`` start N processes on this host with a gloo group each and run picklable
functions on every rank, with a deadline; the processes are children of this one (multiprocessing
``spawn``) or the ranks of one ``mpiexec`` job (``moe_comm.mpiexec``), which MPI code needs.
"""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_from_env", "launcher_rank", "LocalWorld", "spawn", "RankFailure"]

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


# After one rank fails, how long to wait for the others to report (they typically fail at their
# next communication deadline) before giving up on them.
_FAILURE_GRACE_S = 30.0


class RankFailure(RuntimeError):
    """A function run by ``LocalWorld`` raised on one or more ranks; the message has their tracebacks
    and ``results`` maps the ranks that finished to their values."""


def worker_loop(rank: int, world_size: int, store_port: int, backend: str, timeout_s: float, threads: int,
                environ: dict[str, str], tasks: Any, results: Any) -> None:
    """One rank of a ``LocalWorld``: joins the process group through the parent's store, then runs
    ``(fn, args)`` from ``tasks.get()`` until it gets None, putting ``(rank, ok, value or traceback)``
    into ``results``."""
    os.environ.update(environ)
    os.environ.setdefault("MOE_COMM_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    if backend == "nccl":  # one GPU per rank, as torchrun users do with LOCAL_RANK
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(group, *args)))
        except BaseException:  # reported to the parent with the traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _SpawnedRanks:
    """The ranks of a ``LocalWorld`` as children of this process (multiprocessing ``spawn``)."""

    def __init__(self, world_size: int, store_port: int, backend: str, timeout_s: float, threads: int,
                 environ: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=worker_loop, args=(r, world_size, store_port, backend, timeout_s, threads,
                                                             environ, self._tasks[r], self._results), daemon=True)
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
            p.join(timeout=0 if force else 5)
            if p.is_alive():
                p.kill()
                p.join()
        # NOTES: every queue holds named semaphores (/dev/shm/sem.mp-*) until it is collected; let
        # them go with the ranks rather than with this object.
        for q in [self._results, *self._tasks]:
            q.cancel_join_thread()
            q.close()
        self._results, self._tasks = None, []


class LocalWorld:
    """``world_size`` local processes, each in one gloo group, that run functions on request.

    ``run(fn, *args)`` calls ``fn(group, *args)`` on every rank and returns the per-rank results
    (picklable); one process group serves many calls. After a failed or timed-out call the world is
    closed, since ranks may be out of step. ``env`` sets environment variables in the ranks (e.g.
    ``{"MOE_COMM_TRANSPORT": "collective"}``). ``launcher="mpiexec"`` starts the ranks as one MPI
    job (MPI rank r is torch rank r), for code that uses MPI, e.g. the ``mpi`` transport; it needs
    mpi4py and MPICH's ``mpiexec`` (``pip install 'moe-comm[mpi]'``).
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 300.0,
                 threads_per_rank: Optional[int] = None, env: Optional[dict[str, str]] = None,
                 launcher: str = "spawn") -> None:
        if world_size < 1:
            raise ValueError(f"LocalWorld: world_size must be >= 1, got {world_size}")
        if launcher not in ("spawn", "mpiexec"):
            raise ValueError(f"LocalWorld: launcher must be 'spawn' or 'mpiexec', got {launcher!r}")
        self.world_size, self.timeout_s = world_size, timeout_s
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
        # The parent hosts the rendezvous store on a port the OS picks, so concurrent worlds never
        # race for a port (a file store would also grow with every exchange's arrival record).
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        args = (world_size, self._store.port, backend, timeout_s, threads, dict(env or {}))
        if launcher == "mpiexec":
            from .mpiexec import MpiexecRanks
            self._ranks: Any = MpiexecRanks(*args)
        else:
            self._ranks = _SpawnedRanks(*args)
        self.closed = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None) -> list[Any]:
        """Runs ``fn(group, *args)`` on every rank; returns results indexed by rank.

        Raises RankFailure with every failing rank's traceback, or TimeoutError naming the ranks that
        exited or did not finish within ``timeout_s`` (default: the world's); either exception's
        ``results`` holds the values of the ranks that did finish.
        """
        if self.closed:
            raise RuntimeError("LocalWorld.run: this world is closed")
        for rank in range(self.world_size):
            self._ranks.send(rank, (fn, args))
        limit = timeout_s or self.timeout_s
        deadline = time.monotonic() + limit
        done: dict[int, tuple[bool, Any]] = {}
        while len(done) < self.world_size:
            got = self._ranks.receive(max(0.0, min(1.0, deadline - time.monotonic())))
            if got is not None:
                rank, ok, value = got
                done[rank] = (ok, value)
                if not ok:  # peers of a failed rank usually fail too, at their next deadline
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                continue
            dead = [r for r in range(self.world_size) if not self._ranks.alive(r) and r not in done]
            if dead:
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                if len(done) + len(dead) == self.world_size:
                    break
            if time.monotonic() >= deadline:
                break
        missing = sorted(set(range(self.world_size)) - set(done))
        failures = {r: v for r, (ok, v) in done.items() if not ok}
        if failures or missing:
            exited = [r for r in missing if not self._ranks.alive(r)]
            stuck = [r for r in missing if r not in exited]
            self.close(force=True)
            name = getattr(fn, "__name__", fn)
            notes = (f"; ranks {exited} exited" if exited else "") + \
                    (f"; ranks {stuck} did not finish within {limit:g} s" if stuck else "")
            error: Exception
            if failures:
                error = RankFailure(f"LocalWorld.run({name}) failed on ranks {sorted(failures)}{notes}:\n"
                                    + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
            else:
                error = TimeoutError(f"LocalWorld.run({name}): not every rank finished{notes}")
            error.results = {r: v for r, (ok, v) in done.items() if ok}  # type: ignore[attr-defined]
            raise error
        return [done[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stops the workers: asks idle ones to leave their group, kills the rest (all of them when
        ``force``, as after a failure ranks may be blocked in a collective). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._ranks.stop(force)
        del self._store

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = 300.0) -> list[Any]:
    """Runs ``fn(group, *args)`` once on ``world_size`` fresh local ranks; returns per-rank results."""
    with LocalWorld(world_size, backend=backend, timeout_s=timeout_s) as world:
        return world.run(fn, *args)
