"""Correctness gates of the benchmarks: nothing is timed before its outputs were checked."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import accuracy

__all__ = ["calc_diff", "require_all_ranks"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's dissimilarity (``moe_comm.accuracy.calc_diff`` shifted by 1): 0 for identical tensors."""
    return accuracy.calc_diff(x, y, shift=1.0)


def require_all_ranks(ok: bool, bench: str, rank: int, checks: dict[str, float], group: dist.ProcessGroup) -> None:
    """Raises on every rank unless ``ok`` holds on every rank: broken ops are never timed. Collective."""
    flags = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(flags, group=group)
    if flags.item():
        raise RuntimeError(f"{bench}: correctness check failed on {int(flags.item())} rank(s); rank {rank}: "
                           f"{checks}; refusing to time broken ops")
