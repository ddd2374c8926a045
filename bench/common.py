"""Helpers shared by the benchmarks: statistics, tables, JSON records, timing and launching.

Each benchmark defines ``run_rank(group, cfg)`` (collective; returns results on rank 0) and
``report(results, cfg, command, launcher)``; ``launch`` runs it standalone (local ranks), under
torchrun or under mpirun.
"""
from __future__ import annotations

import ctypes
import datetime
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import accuracy
from moe_comm.launch import LocalWorld, init_from_env, launcher_rank


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    """Median, p10/p90 and min/max of per-iteration seconds, in microseconds."""
    us = [s * 1e6 for s in seconds]
    return {"median_us": percentile(us, 50), "p10_us": percentile(us, 10), "p90_us": percentile(us, 90),
            "min_us": min(us), "max_us": max(us)}


def time_calls(fn: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones (perf_counter, this process)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def git_commit() -> dict[str, Any]:
    """HEAD of the repository holding this file and whether the tree has changes; None on failure."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                               timeout=10).stdout.strip() != ""
        return {"commit": head, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    """Host, CPU count, platform and library versions, for the JSON record."""
    return {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "moe_comm": moe_comm.__version__, "gpu": torch.cuda.is_available()}


def format_table(columns: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table; ``columns`` are (key, header); floats get 1-3 decimals by size."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    cells = [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((_, h), w) in enumerate(zip(columns, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(lines)


def write_json(path: str, record: dict[str, Any]) -> None:
    """Writes ``record`` (with date, machine and commit added) to ``path``, creating folders."""
    record = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "git": git_commit(), **record}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2) + "\n")


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's dissimilarity (``moe_comm.accuracy.calc_diff`` shifted by 1): 0 for identical tensors."""
    return accuracy.calc_diff(x, y, shift=1.0)



def time_cases(cases: dict[str, Callable[[], Any]], group: dist.ProcessGroup, warmup: int,
                iters: int) -> dict[str, list[float]]:
    """Per-iteration max-over-ranks seconds of every case. Cases take turns each iteration, so
    that noise from other tenants of a shared machine spreads over all of them alike."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times = torch.zeros(len(cases), iters, dtype=torch.float64)
    for i in range(iters):
        for c, fn in enumerate(cases.values()):
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            times[c, i] = time.perf_counter() - t0
    # elementwise MAX = the per-iteration max over ranks, taken in one collective after the loop
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[c].tolist() for c, name in enumerate(cases)}


def memcpy_bandwidth(group: dist.ProcessGroup, nbytes: int, reps: int = 9) -> dict[str, float]:
    """Single-thread memcpy bandwidth (GB/s) between two pre-faulted buffers of ``nbytes``: per rank
    the median of ``reps`` copies by the faster of libc memcpy and torch's copy_ (one thread), then the
    mean over ranks; ``alone`` while the other ranks wait, ``concurrent`` while every rank copies at
    once (the conditions ranks run in during an exchange). Collective."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    copies = {"libc": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), "torch": lambda: dst.copy_(src)}
    best = torch.zeros(2, dtype=torch.float64)
    try:
        for copy in copies.values():
            alone, together = [], []
            for _ in range(reps):
                for turn in range(ranks):
                    dist.barrier(group)
                    if turn == rank:
                        t0 = time.perf_counter()
                        copy()
                        alone.append(time.perf_counter() - t0)
                dist.barrier(group)
                t0 = time.perf_counter()
                copy()
                together.append(time.perf_counter() - t0)
            mine = torch.tensor([nbytes / percentile(alone, 50) / 1e9, nbytes / percentile(together, 50) / 1e9],
                                dtype=torch.float64)
            best = torch.maximum(best, mine)
    finally:
        torch.set_num_threads(threads)
    dist.all_reduce(best, group=group)  # mean over ranks
    return {"alone": best[0].item() / ranks, "concurrent": best[1].item() / ranks}


def require_all_ranks(ok: bool, bench: str, rank: int, checks: dict[str, float], group: dist.ProcessGroup) -> None:
    """Raises on every rank unless ``ok`` holds on every rank: broken ops are never timed."""
    flags = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flags, group=group)
    if flags.item():
        raise RuntimeError(f"{bench}: correctness check failed on {int(flags.item())} rank(s); rank {rank}: "
                           f"{checks}; refusing to time broken ops")


#: The CPU transports the benchmarks can compare side by side.
#: what the benchmarks compare side by side: the portable backend on each CPU transport, and the
#: cuda_host backend (the CUDA kernels' host build, its handshakes on shm)
TRANSPORTS = ("collective", "shm", "mpi", "cuda_host")


def runs_on(name: str) -> dict[str, str]:
    """``Buffer`` keywords for a name from ``TRANSPORTS``."""
    return {"backend": "cuda_host", "transport": "shm"} if name == "cuda_host" else {"transport": name}


def default_transports() -> list[str]:
    """Every CPU transport that can run in this launch: ``mpi`` needs mpi4py and ranks that are one
    MPI job (mpirun, or the ``mpiexec`` local launch ``launch`` then uses), so not under torchrun."""
    found = launcher_rank()
    mpi = importlib.util.find_spec("mpi4py") is not None and (found is None or found[2].startswith("mpirun"))
    return [t for t in TRANSPORTS if t != "mpi" or mpi]


def mpi_all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                   input_splits: Sequence[int]) -> Callable[[], None]:
    """One raw blocking ``MPI_Alltoallv`` on MPI.COMM_WORLD of the rows of contiguous CPU ``input``
    into ``output`` (as bytes; preallocated): the ceiling of the ``mpi`` transport."""
    from mpi4py import MPI
    row = output.element_size() * output[0].numel() if output.shape[0] else input.element_size() * input[0].numel()

    def spec(t: torch.Tensor, splits: Sequence[int]) -> list:
        counts = [int(n) * row for n in splits]
        displs = [sum(counts[:i]) for i in range(len(counts))]
        return [t.view(torch.uint8).numpy(), (counts, displs), MPI.BYTE]

    send, recv = spec(input, input_splits), spec(output, output_splits)
    return lambda: MPI.COMM_WORLD.Alltoallv(send, recv)


def floor_columns(rows: list[dict[str, Any]], bandwidth: dict[str, float], ops: Sequence[str]) -> None:
    """Adds the memory-copy floor to the rows of moe-comm cases named ``<transport>_<op>`` for ``op``
    in ``ops``, whose bytes are what each rank must receive: ``floor_us`` = bytes / the single-thread memcpy bandwidth
    measured with every rank copying at once, and ``of_floor`` = floor / median (1.0 = as fast as
    one memcpy of the received bytes); ``of_floor_alone`` uses the bandwidth of one rank alone."""
    for r in rows:
        name, _, op = r["case"].partition("_")
        if name in TRANSPORTS and op in ops:
            r["floor_us"] = r["bytes_per_rank_mean"] / (bandwidth["concurrent"] * 1e9) * 1e6
            r["of_floor"] = r["floor_us"] / r["median_us"]
            r["of_floor_alone"] = r["bytes_per_rank_mean"] / (bandwidth["alone"] * 1e9) * 1e6 / r["median_us"]


def vs_transport(rows: list[dict[str, Any]], base: str = "collective") -> None:
    """``vs_<base>``: the ``<base>_<op>`` row's median / this row's, for rows named ``<transport>_<op>``."""
    by = {r["case"]: r for r in rows}
    for r in rows:
        name, _, op = r["case"].partition("_")
        other = by.get(f"{base}_{op}")
        if name in TRANSPORTS and other is not None:
            r[f"vs_{base}"] = other["median_us"] / r["median_us"]


def gather_results(times: dict[str, list[float]], mine_bytes: dict[str, float], checks: dict[str, float],
                   group: dist.ProcessGroup) -> Optional[dict[str, Any]]:
    """On rank 0: ``times_s``, every rank's ``bytes`` per case and ``checks_max_over_ranks``; None
    elsewhere. Collective."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    all_bytes = torch.zeros(num_ranks, len(times), dtype=torch.float64)
    all_bytes[rank] = torch.tensor([mine_bytes[n] for n in times], dtype=torch.float64)
    dist.all_reduce(all_bytes, group=group)
    checks_max = torch.tensor(list(checks.values()), dtype=torch.float64)
    dist.all_reduce(checks_max, op=dist.ReduceOp.MAX, group=group)
    if rank != 0:
        return None
    return {"times_s": times, "bytes": {n: all_bytes[:, c].tolist() for c, n in enumerate(times)},
            "checks_max_over_ranks": dict(zip(checks, checks_max.tolist()))}


def case_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per case: median/p10/p90/min/max µs, a "p10_p90" table cell, the mean bytes per rank
    and every iteration's µs."""
    rows = []
    for name, secs in res["times_s"].items():
        stats = summarize(secs)
        per_rank = res["bytes"][name]
        rows.append({"case": name, **stats, "p10_p90": f"{stats['p10_us']:.0f}/{stats['p90_us']:.0f}",
                     "bytes_per_rank_mean": sum(per_rank) / len(per_rank), "bytes_aggregate": sum(per_rank),
                     "times_us": [s * 1e6 for s in secs]})
    return rows


def launch(run_rank: Callable[[dist.ProcessGroup, dict[str, Any]], Optional[dict[str, Any]]],
           report: Callable[[dict[str, Any], dict[str, Any], str, str], None], cfg: dict[str, Any],
           local_ranks: int, threads_per_rank: int) -> None:
    """Runs ``run_rank`` on every rank and ``report`` on rank 0: on ``local_ranks`` spawned local
    ranks when no launcher (torchrun, mpirun) started this process, else on the launcher's ranks.
    ``threads_per_rank`` 0 means cpu_count // local ranks, at least 1."""
    found = launcher_rank()
    ranks = found[1] if found else local_ranks
    on_host = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("MPI_LOCALNRANKS", ranks)))
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // on_host)
    cfg["ranks"] = ranks
    command = " ".join([Path(sys.executable).name] + sys.argv)
    if found is None:
        launcher = "mpiexec" if "mpi" in cfg.get("transports", ()) else "spawn"
        with LocalWorld(ranks, threads_per_rank=threads, timeout_s=1800, launcher=launcher) as world:
            res = world.run(run_rank, cfg)[0]
        report(res, cfg, command, f"moe_comm.launch.LocalWorld ({launcher})")
        return
    # Under a launcher: cap the kernel and torch threads before any kernel runs (cpu_threads is cached).
    os.environ.setdefault("MOE_COMM_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    group = init_from_env()
    try:
        res = run_rank(group, cfg)
        if res is not None:
            report(res, cfg, f"{found[2]} x{ranks}: {command}", found[2])
        dist.barrier(group)
    finally:
        dist.destroy_process_group()


def launched_ranks(default: int) -> int:
    """The launcher's world size, or ``default`` when no launcher started this process."""
    found = launcher_rank()
    return found[1] if found else default
