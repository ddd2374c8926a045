"""``LocalWorld`` / ``spawn``: N processes on this host, one gloo group among them, that run
picklable functions on every rank with a deadline. The ranks are started by this process (forked from
multiprocessing's forkserver, which has imported torch and moe_comm once: ``spawned.py``) or are one
``mpiexec`` job (``mpiexec.py``), which MPI code needs.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from .mpiexec import MpiexecRanks
from .spawned import SpawnedRanks
from .worker import Ranks

__all__ = ["LocalWorld", "spawn", "RankFailure"]

# After one rank fails, how long to wait for the others to report (they typically fail at their
# next communication deadline) before giving up on them.
_FAILURE_GRACE_S = 30.0


class RankFailure(RuntimeError):
    """A function run by ``LocalWorld`` raised on one or more ranks; the message has their tracebacks
    and ``results`` maps the ranks that finished to their values."""


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
        self._ranks: Ranks = MpiexecRanks(*args) if launcher == "mpiexec" else SpawnedRanks(*args)
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
