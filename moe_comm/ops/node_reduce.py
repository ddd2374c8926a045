"""The combine sum of a group that spans several nodes, in DeepEP's internode order.

DeepEP's internode combine sums a token's rows in two levels: the forwarder of each node adds the
rows of that node's ranks (fp32, ranks ascending) and rounds the partial sum to x's dtype for the
network; the token's rank then adds the nodes' partials (fp32, nodes ascending) and the biases.
``combine_reduce_by_node`` is that order on top of ``combine_reduce`` (one call per node, one across
nodes), so it is exact and deterministic wherever ``combine_reduce`` is.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..core.topology import Topology
from .combine_reduce import Records, combine_reduce
from .records import RecordLayout

__all__ = ["combine_reduce_by_node"]


def combine_reduce_by_node(layout: RecordLayout, records: Records, send_pos: torch.Tensor,
                           bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], out: torch.Tensor,
                           out_weights: Optional[torch.Tensor], *, topology: Topology) -> None:
    """``combine_reduce`` (same arguments; sources are ranks) summed per node first:
    ``out[t] = round(((0 + p_0 + p_1 + ...) + bias0[t]) + bias1[t])`` over nodes n ascending that hold
    a row of t, with ``p_n = float(round(0 + x_r + ...))`` over node n's ranks ascending (each round
    to x's dtype, every add in fp32). ``out_weights`` sums the same way without rounding."""
    num_tokens, num_ranks = send_pos.shape
    sources = [records] * num_ranks if isinstance(records, torch.Tensor) else list(records)
    hidden = out.shape[1]
    partials, node_pos = [], torch.full((num_tokens, topology.num_nodes), -1, dtype=torch.int32,
                                        device=send_pos.device)
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=send_pos.device)
    for node in range(topology.num_nodes):
        ranks = [r for r in (topology.rank_at(node, i) for i in range(topology.ranks_per_node)) if r is not None]
        pos = send_pos[:, ranks].contiguous()
        partial = torch.empty(num_tokens, layout.record_bytes, dtype=torch.uint8, device=out.device)
        part_x = torch.empty(num_tokens, hidden, dtype=out.dtype, device=out.device)
        part_w = None if out_weights is None else torch.empty_like(out_weights)
        combine_reduce(layout, [sources[r] for r in ranks], pos, None, None, part_x, part_w)
        layout.view(partial, "x").copy_(part_x)
        if part_w is not None:
            layout.view(partial, "weights").copy_(part_w)
        partials.append(partial)
        node_pos[:, node] = torch.where((pos >= 0).any(1), tokens, -1)
    combine_reduce(layout, partials, node_pos, bias0, bias1, out, out_weights)
