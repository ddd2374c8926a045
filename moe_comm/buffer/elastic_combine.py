"""The sum order of DeepEP V2's combine, on the rows returned to a token's rank.

DeepEP V2 sums a token's contributions in top-k slot order, in fp32, starting from the biases
(``bias0 + bias1``). Where several slots share a rank (and, in hybrid mode with multiple reductions
allowed, a node), their contributions are summed first, in slot order, rounded to the row dtype and
counted at the group's last slot. ``sum_in_slot_order`` computes exactly that with ``ops.combine_reduce``
(which sums its sources ascending in fp32 from 0), so it is bitwise what DeepEP's tests expect.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.combine_reduce import combine_reduce
from ..ops.records import RecordLayout
from .elastic_layout import last_of_group

__all__ = ["sum_in_slot_order", "sum_expanded_rows", "pick_slot_weights"]


def _records(rows: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """``rows`` `[N, H]` as ``layout``'s uint8 records (a view when the row is exactly a record)."""
    row_bytes = rows.shape[1] * rows.element_size()
    if row_bytes == layout.record_bytes and rows.is_contiguous():
        return rows.view(torch.uint8)  # [N, row_bytes]
    records = torch.zeros(rows.shape[0], layout.record_bytes, dtype=torch.uint8, device=rows.device)
    layout.view(records, "x").copy_(rows)
    return records


def sum_in_slot_order(rows: torch.Tensor, slot_rows: torch.Tensor, rank_of_slot: Optional[torch.Tensor],
                      node_of_slot: Optional[torch.Tensor], num_nodes: int, bias0: Optional[torch.Tensor],
                      bias1: Optional[torch.Tensor]) -> torch.Tensor:
    """Combined rows `[T, H]` of ``rows``' dtype.

    Args:
        rows: `[N, H]` returned rows.
        slot_rows: `[T, K]` int64: the row of ``rows`` holding slot k's contribution, -1 for none.
        rank_of_slot: `[T, K]` the rank of each slot (-1 none), when a row is a rank's sum of its slots
            (only the rank's last slot counts it); None when every slot has its own row.
        node_of_slot: `[T, K]` the node of each slot, for the intermediate per-node sum; or None.
        num_nodes: nodes ``node_of_slot`` numbers.
        bias0, bias1: optional `[T, H]` of ``rows``' dtype, the first terms of the sum.
    """
    num_tokens, num_topk = slot_rows.shape
    hidden, dtype, device = rows.shape[1], rows.dtype, rows.device
    layout = RecordLayout.build([("x", dtype, hidden)])
    records = _records(rows, layout)
    pos = slot_rows if rank_of_slot is None else torch.where(last_of_group(rank_of_slot), slot_rows, -1)
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=device).unsqueeze(1)
    if node_of_slot is not None:
        partials = []
        for node in range(num_nodes):
            partial = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
            mine = torch.where(node_of_slot == node, pos, -1).to(torch.int32)
            combine_reduce(layout, records, mine, None, None, partial, None)
            partials.append(partial)
        records = _records(torch.cat(partials) if partials else rows[:0], layout)
        pos = torch.where(last_of_group(node_of_slot), node_of_slot * num_tokens + tokens, -1)
    biases = [b for b in (bias0, bias1) if b is not None]
    sources = [_records(b.contiguous(), layout) for b in biases] + [records] * num_topk
    send_pos = torch.cat([tokens.expand(num_tokens, len(biases)), pos], 1).to(torch.int32).contiguous()
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    combine_reduce(layout, sources, send_pos, None, None, out, None)
    return out


def pick_slot_weights(weights: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """``out[t, k] = weights[slot_rows[t, k], k]`` (0 where ``slot_rows`` is -1): each slot's weight as the
    rank holding its expert returned it. float32 `[T, K]`."""
    num_topk = slot_rows.shape[1]
    flat = slot_rows.clamp(min=0) * num_topk + torch.arange(num_topk, device=slot_rows.device)
    picked = weights.reshape(-1)[flat] if weights.numel() else torch.zeros(slot_rows.shape, device=slot_rows.device)
    return torch.where(slot_rows >= 0, picked, 0.0).to(torch.float32)


def sum_expanded_rows(x: torch.Tensor, weights: Optional[torch.Tensor], slots: torch.Tensor
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """For each received row, the sum of its expanded rows ``x[slots[i, k]]`` in slot order (fp32, rounded to
    x's dtype: DeepEP V2's reduction before a rank returns a token), and each slot's weight
    ``weights[slots[i, k]]`` (0 where the slot is -1). Returns `[N, H]` and `[N, K]` float32 or None."""
    layout = RecordLayout.build([("x", x.dtype, x.shape[1])])
    out = torch.empty(slots.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    combine_reduce(layout, _records(x, layout), slots.to(torch.int32).contiguous(), None, None, out, None)
    if weights is None:
        return out, None
    return out, torch.where(slots >= 0, weights[slots.clamp(min=0).to(torch.int64)], 0.0)
