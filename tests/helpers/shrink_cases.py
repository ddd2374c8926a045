"""Shrink by timeout inside ranks: ranks that stay alive but stop calling, as DeepEP's ``--shrink-test``."""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import moe_comm

from helpers.shm_cases import _inputs

#: rank -> the low-latency call it stops before (it stays alive, idle, until the others are done)
STOPS = {1: "dispatch", 3: "combine", 4: "clean"}
M, H, K = 8, 256, 3


def _diff(y: torch.Tensor, ref: torch.Tensor) -> float:
    """DeepEP's calc_diff."""
    y, ref = y.double(), ref.double()
    return float(1 - 2 * (y * ref).sum() / ((y * y).sum() + (ref * ref).sum()))


def stopped_ranks(group: dist.ProcessGroup, timeout_s: float) -> dict[str, Any]:
    """Five ranks; rank 1 stops before a dispatch, rank 3 before a combine, rank 4 before a clean.
    Each survivor reports, after each call, the mask and checks against a reference of the live
    ranks; then a second dispatch and combine run among the survivors. Every stopped rank, once the
    others are done, makes one more call and reports its error."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    E = 2 * R
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    dist.barrier(group)  # every rank must reach each call within timeout_s of the others, or it is masked
    buf = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True, timeout_s=timeout_s)
    x, idx, w = _inputs(rank, M, H, E, K, seed=3)
    every_idx = [torch.empty_like(idx) for _ in range(R)]
    dist.all_gather(every_idx, idx, group=group)
    status = torch.zeros(R, dtype=torch.int32)
    out: dict[str, Any] = {"masks": {}, "seconds": {}}

    def mask() -> list[int]:
        buf.low_latency_query_mask_buffer(status)
        return status.tolist()

    def dispatch_and_check(name: str) -> Any:
        start = time.monotonic()
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        out["seconds"][name] = time.monotonic() - start
        out["masks"][name] = live = mask()
        local = E // R
        want = [sum(int((every_idx[s] == rank * local + e).sum()) for s in range(R) if not live[s])
                for e in range(local)]
        out[f"{name}_counts_ok"] = count.tolist() == want
        return recv, handle

    def combine_and_check(name: str, recv: torch.Tensor, handle: Any) -> None:
        start = time.monotonic()
        y, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        out["seconds"][name] = time.monotonic() - start
        out["masks"][name] = live = mask()
        owner_alive = torch.tensor([not live[e // (E // R)] for e in range(E)])
        kept = (idx >= 0) & owner_alive[idx.clamp(min=0)]
        out[f"{name}_diff"] = _diff(y, x.float() * (w * kept).sum(1, keepdim=True))

    stop = STOPS.get(rank)
    if stop != "dispatch":
        recv, handle = dispatch_and_check("dispatch")
        if stop != "combine":
            combine_and_check("combine", recv, handle)
            if stop != "clean":
                start = time.monotonic()
                buf.clean_low_latency_buffer(M, H, E)
                out["seconds"]["clean"] = time.monotonic() - start
                out["masks"]["clean"] = mask()
                recv, handle = dispatch_and_check("dispatch_again")
                combine_and_check("combine_again", recv, handle)
    dist.barrier(group)  # the stopped ranks wait here, idle, for the others
    if stop is not None:
        try:
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            out["late_call"] = ("no exception", "")
        except Exception as exc:  # the test checks which
            out["late_call"] = (type(exc).__name__, str(exc))
    return out


def slow_rank(group: dist.ProcessGroup, short_s: float, delay_s: float, long_s: float) -> dict[str, Any]:
    """Three ranks whose deadlines differ: rank 0 waits ``short_s``, rank 2 waits ``long_s``, and rank 1
    comes to a dispatch ``delay_s`` late, after rank 0's deadline but before rank 2's. Rank 2 hears
    rank 1, rank 0 does not: both must still mask it (the same mask), and rank 1 must learn that it was
    masked instead of carrying on. Returns the outcome, mask and count check of each rank."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    E = 2 * R
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    buf = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True,
                          timeout_s={0: short_s, 1: long_s, 2: long_s}[rank])
    x, idx, _ = _inputs(rank, M, H, E, K, seed=5)
    every_idx = [torch.empty_like(idx) for _ in range(R)]
    dist.all_gather(every_idx, idx, group=group)
    if rank == 1:
        time.sleep(delay_s)
    status = torch.zeros(R, dtype=torch.int32)
    try:
        _, count, _, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    except Exception as exc:  # the test checks which
        return {"outcome": (type(exc).__name__, str(exc))}
    buf.low_latency_query_mask_buffer(status)
    local = E // R
    want = [sum(int((every_idx[s] == rank * local + e).sum()) for s in range(R) if not status[s])
            for e in range(local)]
    return {"outcome": ("no exception", ""), "mask": status.tolist(), "counts_ok": count.tolist() == want}
