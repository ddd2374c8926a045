"""The physical floors measured beside every distributed benchmark, in the same run: the memory-copy
floor (the bytes a rank must receive / single-thread memcpy bandwidth) and the raw all-to-all
(``MPI_Alltoallv`` here; gloo's ``all_to_all_single`` is called by each benchmark), and the columns
that set each case against them."""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .stats import percentile
from .transports import split_case

__all__ = ["memcpy_bandwidth", "mpi_all_to_all", "floor_columns", "vs_transport"]


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
    in ``ops``, whose bytes are what each rank must receive: ``floor_us`` = bytes / the single-thread memcpy
    bandwidth measured with every rank copying at once, and ``of_floor`` = floor / median (1.0 = as fast as
    one memcpy of the received bytes); ``of_floor_alone`` uses the bandwidth of one rank alone."""
    for r in rows:
        split = split_case(r["case"])
        if split is not None and split[1] in ops:
            r["floor_us"] = r["bytes_per_rank_mean"] / (bandwidth["concurrent"] * 1e9) * 1e6
            r["of_floor"] = r["floor_us"] / r["median_us"]
            r["of_floor_alone"] = r["bytes_per_rank_mean"] / (bandwidth["alone"] * 1e9) * 1e6 / r["median_us"]


def vs_transport(rows: list[dict[str, Any]], base: str = "collective") -> None:
    """``vs_<base>``: the ``<base>_<op>`` row's median / this row's, for rows named ``<transport>_<op>``."""
    by = {r["case"]: r for r in rows}
    for r in rows:
        split = split_case(r["case"])
        other = by.get(f"{base}_{split[1]}") if split else None
        if other is not None:
            r[f"vs_{base}"] = other["median_us"] / r["median_us"]
