"""Single-process MoE references for the EP layer: ``dense_moe`` (the same ops, all experts in one
process: the layer's exact result when given the same micro-batches and reduction order),
``dense_moe_reference`` (its fp64 specification after the expert FFN) and ``ep_moe_reference`` (what
every rank of an EP forward must return, from every rank's inputs)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..ops import permute, unpermute_reduce, unpermute_reduce_reference
from .experts import Experts
from .schedules import LOW_LATENCY_MODES, micro_batches, num_micro_batches

__all__ = ["dense_moe", "dense_moe_reference", "ep_moe_reference"]


def _expert_outputs(x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts, impl: Optional[str]):
    """(permutation of x by topk_idx, the FFN's bf16 output for each of its rows)."""
    perm = permute(x, topk_idx, experts.num_experts, quant="e4m3" if experts.fp8 else None, impl=impl)
    return perm, experts.ffn(perm.x, expert_offsets=perm.expert_offsets, x_scales=perm.scales, impl=impl)


def _rank_rows(topk_idx: torch.Tensor, row_of: torch.Tensor, num_experts: int, rank_groups: int) -> list[torch.Tensor]:
    """``row_of`` restricted, for each of ``rank_groups`` consecutive expert groups, to that group's slots."""
    group = torch.where(topk_idx >= 0, topk_idx // (num_experts // rank_groups), -1)
    return [torch.where(group == r, row_of, -1) for r in range(rank_groups)]


def dense_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts, *,
              rank_groups: int = 1, impl: Optional[str] = None) -> torch.Tensor:
    """Every expert in this process: `[T, H]` bf16 with ``out[t] = bf16(sum_k w[t, k] * y(t, k))``, k ascending
    in fp32, ``y`` the expert FFN (FP8 experts see x cast per token to E4M3). With ``rank_groups`` R the
    experts are R consecutive equal groups (the ranks of EP normal mode) and the sum is two-level as
    there: each group's slots summed and rounded to bf16, then the groups summed ascending in fp32."""
    perm, y = _expert_outputs(x, topk_idx, experts, impl)
    if rank_groups == 1:
        return unpermute_reduce(y, perm.row_of, topk_weights, impl=impl)
    total = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for rows in _rank_rows(topk_idx, perm.row_of, experts.num_experts, rank_groups):
        total += unpermute_reduce(y, rows, topk_weights, impl=impl).to(torch.float32)
    return total.to(torch.bfloat16)


def dense_moe_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts, *,
                        rank_groups: int = 1, impl: Optional[str] = None) -> torch.Tensor:
    """fp64 specification of ``dense_moe`` (float64 `[T, H]`) from the FFN op's bf16 expert outputs: the
    routing, weighting and reduction in fp64, rounding only where the layer defines it (with
    ``rank_groups``, each group's share to bf16). The FFN op itself is held to the accuracy standard by
    ``moe_comm.accuracy``; starting from its outputs (on ``impl``) keeps a bf16 output that rounds the
    other way from being amplified by tokens whose terms cancel."""
    perm, y = _expert_outputs(x, topk_idx, experts, impl)
    if rank_groups == 1:
        return unpermute_reduce_reference(y, perm.row_of, topk_weights)
    shares = [unpermute_reduce_reference(y, rows, topk_weights)
              for rows in _rank_rows(topk_idx, perm.row_of, experts.num_experts, rank_groups)]
    return sum(share.to(torch.bfloat16).to(torch.float64) for share in shares)


def ep_moe_reference(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
                     topk_weights: Sequence[torch.Tensor], experts: Experts, mode: str, num_chunks: int = 1, *,
                     fp64: bool = False, impl: Optional[str] = None) -> list[torch.Tensor]:
    """Each rank's output of an EP forward in ``mode`` over ``len(xs)`` ranks (rank r's inputs at index
    r; ``experts`` holds every expert, rank r owning the r-th consecutive share), computed by
    ``dense_moe`` (or, with ``fp64``, ``dense_moe_reference``) on each micro-batch of all ranks' tokens
    with the mode's reduction order, so that every expert sees the rows it sees in the EP forward."""
    ranks = len(xs)
    count = num_micro_batches(mode, num_chunks)
    splits = [micro_batches(x.shape[0], count) for x in xs]
    groups = 1 if mode in LOW_LATENCY_MODES else ranks
    outs: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for c in range(count):
        parts = [s[c] for s in splits]
        batch = [torch.cat([t[p] for t, p in zip(ts, parts)]) for ts in (xs, topk_idxs, topk_weights)]
        out = dense_moe_reference(*batch, experts, rank_groups=groups, impl=impl) if fp64 else \
            dense_moe(*batch, experts, rank_groups=groups, impl=impl)
        for r, piece in enumerate(out.split([p.stop - p.start for p in parts])):
            outs[r].append(piece)
    return [torch.cat(o) for o in outs]
