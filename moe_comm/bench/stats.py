"""Timing and statistics of the benchmarks: per-call timings, per-iteration max over ranks, and the
median / p10 / p90 / min / max of them in microseconds."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["percentile", "summarize", "time_calls", "time_cases", "gather_results", "case_rows"]


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


def time_cases(cases: dict[str, Callable[[], Any]], group: dist.ProcessGroup, warmup: int,
               iters: int, after_previous: frozenset[str] = frozenset()) -> dict[str, list[float]]:
    """Per-iteration max-over-ranks seconds of every case. Collective. Cases take turns each
    iteration, so that noise from other tenants of a shared machine spreads over all of them alike,
    and the turn starts one case later each iteration: the case that follows the last one's
    collective (gloo's threads still winding down on a 2-core machine) is each case in turn. A case
    named in ``after_previous`` (a hook's receive half) never starts a turn: it runs right after the
    case before it in ``cases``."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    fns = list(cases.values())
    starts = [c for c, name in enumerate(cases) if name not in after_previous]
    times = torch.zeros(len(fns), iters, dtype=torch.float64)
    for i in range(iters):
        for j in range(len(fns)):
            c = (starts[i % len(starts)] + j) % len(fns)
            fn = fns[c]
            dist.barrier(group)
            t0 = time.perf_counter()
            fn()
            times[c, i] = time.perf_counter() - t0
    # elementwise MAX = the per-iteration max over ranks, taken in one collective after the loop
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[c].tolist() for c, name in enumerate(cases)}


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
    """One row per case of ``gather_results``'s record: median/p10/p90/min/max µs, a "p10_p90" table
    cell, the mean and the sum over ranks of the bytes per rank, and every iteration's µs."""
    rows = []
    for name, secs in res["times_s"].items():
        stats = summarize(secs)
        per_rank = res["bytes"][name]
        rows.append({"case": name, **stats, "p10_p90": f"{stats['p10_us']:.0f}/{stats['p90_us']:.0f}",
                     "bytes_per_rank_mean": sum(per_rank) / len(per_rank), "bytes_aggregate": sum(per_rank),
                     "times_us": [s * 1e6 for s in secs]})
    return rows
