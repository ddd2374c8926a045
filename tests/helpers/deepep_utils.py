"""Helpers ported from DeepEP's test helpers (same formulas), for use inside ranks. The FP8 casts
are the library's own (``moe_comm.ops.per_token_cast_to_fp8`` / ``per_token_cast_back``)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's dissimilarity: 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2); 0 when identical."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Per row: unique values >= 0, sorted descending, padded with -1 (DeepEP's helper)."""
    assert x.dim() == 2
    mask = x < 0
    x_padded = x.masked_fill(mask, num_slots)
    bin_count = torch.zeros((x.size(0), num_slots + 1), dtype=x.dtype)
    bin_count.scatter_add_(1, x_padded, torch.ones_like(x_padded))
    bin_count = bin_count[:, :num_slots]
    sorted_bin_count, sorted_bin_idx = torch.sort(bin_count, dim=-1, descending=True)
    sorted_bin_idx.masked_fill_(sorted_bin_count == 0, -1)
    sorted_bin_idx = torch.sort(sorted_bin_idx, descending=True, dim=-1).values
    x[:, :].fill_(-1)
    valid_len = min(num_slots, x.size(1))
    x[:, :valid_len] = sorted_bin_idx[:, :valid_len]


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t
