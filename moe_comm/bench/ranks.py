"""Starting a distributed benchmark's ranks: spawned here (``--ranks N``, ``moe_comm.launch.LocalWorld``)
when no launcher started this process, else the launcher's (torchrun, mpirun)."""
from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..launch import LocalWorld, init_from_env, launcher_rank

__all__ = ["launch", "launch_token_counts", "launched_ranks", "RunRank", "Report"]

#: ``run_rank(group, cfg)``: collective over ``group``; the run's results on rank 0, None elsewhere.
#: Module-level, so that ``LocalWorld`` can send it to its ranks by name.
RunRank = Callable[[dist.ProcessGroup, dict[str, Any]], Optional[dict[str, Any]]]
#: ``report(results, command, launcher)``: on rank 0 only, one result per cfg, in the order given.
Report = Callable[[list[dict[str, Any]], str, str], None]

# How long a local launch may take for one cfg (the benchmarks' largest shapes run for minutes).
_LOCAL_TIMEOUT_S = 1800


def launch(run_rank: RunRank, cfgs: Sequence[dict[str, Any]], report: Report, *, command: str,
           local_ranks: int, threads_per_rank: int) -> None:
    """Runs ``run_rank`` on every rank for each cfg in turn (one process group serves them all), then
    ``report`` on rank 0: on ``local_ranks`` spawned local ranks when no launcher (torchrun, mpirun)
    started this process (as one mpiexec job when a cfg's ``transports`` name ``mpi``), else on the
    launcher's ranks. Sets ``cfg["ranks"]`` in every cfg. ``threads_per_rank`` 0 means
    cpu_count // ranks on this host, at least 1."""
    found = launcher_rank()
    ranks = found[1] if found else local_ranks
    on_host = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("MPI_LOCALNRANKS", ranks)))
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // on_host)
    for cfg in cfgs:
        cfg["ranks"] = ranks
    if found is None:
        launcher = "mpiexec" if any("mpi" in cfg.get("transports", ()) for cfg in cfgs) else "spawn"
        with LocalWorld(ranks, threads_per_rank=threads, timeout_s=_LOCAL_TIMEOUT_S, launcher=launcher) as world:
            results = [world.run(run_rank, cfg)[0] for cfg in cfgs]
        report(results, command, f"moe_comm.launch.LocalWorld ({launcher})")
        return
    # Under a launcher: cap the kernel and torch threads before any kernel runs (cpu_threads is cached).
    os.environ.setdefault("MOE_COMM_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    group = init_from_env()
    try:
        results = [run_rank(group, cfg) for cfg in cfgs]
        if dist.get_rank(group) == 0:
            report(results, f"{found[2]} x{ranks}: {command}", found[2])
        dist.barrier(group)  # the others wait for rank 0 (the rendezvous store's host) to finish reporting
    finally:
        dist.destroy_process_group()


def launched_ranks(default: int) -> int:
    """The launcher's world size, or ``default`` when no launcher started this process."""
    found = launcher_rank()
    return found[1] if found else default


def launch_token_counts(bench: str, run_rank: RunRank, report: Callable[..., None], args: argparse.Namespace,
                        keys: Sequence[str], command: str) -> None:
    """A routing benchmark's ``main`` after parsing: checks ``args`` against the launched (or
    ``--ranks``) rank count (SystemExit naming ``bench``), then ``launch``es one cfg per ``--tokens``
    count holding ``tokens`` and the ``keys`` of ``args``; ``report`` also gets ``cfgs``, ``json_path``
    and ``plot_path``."""
    ranks = launched_ranks(args.ranks)
    if args.experts % ranks:
        raise SystemExit(f"{bench}: --experts ({args.experts}) must be a multiple of the rank count ({ranks})")
    if args.hidden % 128:
        raise SystemExit(f"{bench}: --hidden ({args.hidden}) must be a multiple of 128 for the FP8 scales")
    if not 1 <= args.topk <= args.experts or args.iters < 1:
        raise SystemExit(f"{bench}: need 1 <= --topk <= --experts and --iters >= 1, got {vars(args)}")
    cfgs = [{"tokens": t, **{k: getattr(args, k) for k in keys}} for t in args.tokens]
    launch(run_rank, cfgs, functools.partial(report, cfgs=cfgs, json_path=args.json, plot_path=args.plot),
           command=command, local_ranks=args.ranks, threads_per_rank=args.threads_per_rank)
