"""The layouts of DeepEP V2's ``ElasticBuffer`` outputs, computed from a V1 dispatch's routing.

Every function here is local tensor arithmetic on the device of its inputs, with no host read of tensor
data, so a dispatch called with ``do_cpu_sync=False`` stays free of host synchronisation in this layer.
Rows are the V1 dispatch's received rows: grouped by source rank ascending, then by source token
ascending, which is the order DeepEP V2 gives with ``deterministic=True`` (sorted by
``src_token_global_idx = src_rank * num_max_tokens_per_rank + src_token``).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["source_ranks", "expert_counts", "aligned", "expanded_slots", "src_metadata", "dst_buffer_slots",
           "slot_ranks", "last_of_group", "slot_positions"]


def source_ranks(rank_prefix: torch.Tensor, rows: int) -> torch.Tensor:
    """Source rank of each of ``rows`` received rows, from the inclusive prefix of rows received per source
    rank (`[R]`); padding rows past the last get R. int64 `[rows]`."""
    positions = torch.arange(rows, dtype=torch.int64, device=rank_prefix.device)
    return torch.searchsorted(rank_prefix.to(torch.int64).contiguous(), positions, right=True)


def expert_counts(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Rows received per local expert (entries -1 are not counted). int32 `[num_local_experts]`."""
    key = _expert_key(recv_topk_idx, num_local_experts)
    counts = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=recv_topk_idx.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return counts[:num_local_experts].to(torch.int32)


def aligned(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """``counts`` each rounded up to a multiple of ``alignment``."""
    return (counts + alignment - 1) // alignment * alignment


def _expert_key(recv_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    flat = recv_topk_idx.reshape(-1).to(torch.int64)
    return torch.where(flat >= 0, flat, num_local_experts)


def expanded_slots(recv_topk_idx: torch.Tensor, counts: torch.Tensor, alignment: int) -> torch.Tensor:
    """The row of each (received row, top-k slot) in DeepEP V2's expanded layout, or -1 where the slot's
    expert is not local: expert e's rows start at the sum of the aligned counts of experts before it, and
    hold its entries in received-row order. int32 `[N, K]`."""
    num_rows, num_topk = recv_topk_idx.shape
    num_local_experts = counts.shape[0]
    key = _expert_key(recv_topk_idx, num_local_experts)
    counts64 = counts.to(torch.int64)
    zero = torch.zeros(1, dtype=torch.int64, device=key.device)
    first_entry = torch.cat([zero, counts64.cumsum(0)])            # where each expert's entries start, sorted
    first_row = torch.cat([zero, aligned(counts64, alignment).cumsum(0)])
    order = torch.sort(key, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), dtype=torch.int64, device=key.device)
    rows = first_row[key] + rank - first_entry[key]
    return torch.where(key < num_local_experts, rows, -1).to(torch.int32).view(num_rows, num_topk)


def src_metadata(src_rank: torch.Tensor, recv_src_idx: torch.Tensor, recv_topk_idx: torch.Tensor,
                 slots: Optional[torch.Tensor], num_max_tokens_per_rank: int) -> torch.Tensor:
    """DeepEP V2's ``recv_src_metadata`` `[N, K + 2]` int32: column 0 the source token's global index
    (``src_rank * num_max_tokens_per_rank + src_token``), column 1 ``src_rank * K`` plus the first top-k slot
    whose expert is local, columns 2.. the expanded rows (``expanded_slots``; -1 without ``do_expand``).
    Padding rows are -1 throughout."""
    num_rows, num_topk = recv_topk_idx.shape
    valid = recv_src_idx >= 0
    local = recv_topk_idx >= 0
    first = torch.where(local.any(1), local.to(torch.int8).argmax(1), 0)
    meta = torch.empty(num_rows, num_topk + 2, dtype=torch.int32, device=recv_topk_idx.device)
    meta[:, 0] = torch.where(valid, src_rank * num_max_tokens_per_rank + recv_src_idx, -1)
    meta[:, 1] = torch.where(valid, src_rank * num_topk + first, -1)
    meta[:, 2:] = -1 if slots is None else slots
    return meta


def slot_ranks(topk_idx: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """The rank holding each top-k slot's expert, -1 for slots without one. int64 `[T, K]`."""
    return torch.where(topk_idx >= 0, torch.div(topk_idx, experts_per_rank, rounding_mode="floor"), -1)


def dst_buffer_slots(ranks: torch.Tensor, send_head: torch.Tensor, rank_prefix: torch.Tensor,
                     is_token_in_rank: torch.Tensor, me: int) -> torch.Tensor:
    """Row of each (token, slot) at the rank holding the slot's expert (the row that rank's dispatch
    returned for the token), -1 for slots without an expert. int32 `[T, K]`."""
    sent = is_token_in_rank.sum(0, dtype=torch.int64)
    first_sent = sent.cumsum(0) - sent                            # start of each destination's block in send_head
    before_me = rank_prefix[me - 1].to(torch.int64) if me > 0 else torch.zeros_like(sent)
    row_at = send_head.to(torch.int64) - first_sent + before_me   # [T, R]
    safe = ranks.clamp(min=0)
    rows = torch.gather(row_at, 1, safe)
    return torch.where(ranks >= 0, rows, -1).to(torch.int32)


def last_of_group(groups: torch.Tensor) -> torch.Tensor:
    """Whether each top-k slot is the last slot of its group (rank or node) in its token, for slots with a
    group (>= 0). bool `[T, K]`."""
    num_topk = groups.shape[1]
    later = torch.ones(num_topk, num_topk, dtype=torch.bool, device=groups.device).triu(1)   # [k, k'] k' > k
    same = groups.unsqueeze(2) == groups.unsqueeze(1)
    return (groups >= 0) & ~(same & later).any(2)


def slot_positions(ranks: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """For rows returned one per (token, slot), grouped by rank then token then slot: each slot's row, -1 for
    slots without an expert. int64 `[T, K]`."""
    flat = ranks.reshape(-1)
    key = torch.where(flat >= 0, flat, num_ranks)
    order = torch.sort(key, stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), dtype=torch.int64, device=ranks.device)
    return torch.where(flat >= 0, position, -1).view(ranks.shape)
