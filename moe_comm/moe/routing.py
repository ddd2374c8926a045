"""Top-k expert selection from router logits: softmax or sigmoid scores, optionally group-limited and
bias-corrected as in DeepSeek-V3 (vLLM's ``grouped_topk``, SGLang's ``biased_grouped_topk``)."""
from __future__ import annotations

from typing import Optional

import torch

from ..core.checks import check_int, check_tensor, describe
from ..core.errors import bad_argument

__all__ = ["SCORINGS", "select_experts"]

SCORINGS = ("softmax", "sigmoid")


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
                   correction_bias: Optional[torch.Tensor] = None, renormalize: bool = False,
                   scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes each token to ``top_k`` distinct experts.

    Scores are ``softmax`` or ``sigmoid`` of the fp32 logits `[T, E]`. ``correction_bias`` `[E]` is added
    for selection only (the weights stay unbiased scores). With ``num_groups``, experts form that many
    equal groups; a group's score is its best biased score (or, with a bias, the sum of its best two),
    and only experts in the ``topk_groups`` best groups can be picked. Weights are the picked scores,
    divided by their sum with ``renormalize``, times ``scaling_factor``.

    Returns ``(topk_idx [T, top_k] int64, topk_weights [T, top_k] float32)``, best first; the same
    inputs give the same outputs.
    """
    op = "select_experts"
    check_tensor(op, "router_logits", router_logits, shape=(None, None))
    if not router_logits.is_floating_point():
        bad_argument(op, "router_logits", "a floating-point tensor", describe(router_logits), kind=TypeError)
    num_tokens, num_experts = router_logits.shape
    check_int(op, "top_k", top_k, minimum=1)
    if scoring not in SCORINGS:
        bad_argument(op, "scoring", f"one of {list(SCORINGS)}", repr(scoring))
    logits = router_logits.to(torch.float32)
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    chosen_by = scores
    if correction_bias is not None:
        check_tensor(op, "correction_bias", correction_bias, shape=(num_experts,), device=router_logits.device)
        chosen_by = scores + correction_bias.to(torch.float32)
    if (num_groups is None) != (topk_groups is None):
        bad_argument(op, "num_groups and topk_groups", "given together", f"{num_groups!r} and {topk_groups!r}")
    if num_groups is not None:
        check_int(op, "num_groups", num_groups, minimum=1)
        check_int(op, "topk_groups", topk_groups, minimum=1)
        if num_experts % num_groups or topk_groups > num_groups:
            bad_argument(op, "num_groups and topk_groups", f"num_groups dividing the {num_experts} experts and "
                         f"topk_groups <= num_groups", f"{num_groups} and {topk_groups}")
        per_group = num_experts // num_groups
        if correction_bias is not None and per_group < 2:
            bad_argument(op, "num_groups", "at most num_experts / 2 with a correction_bias (a group scores its "
                         "best two)", num_groups)
        grouped = chosen_by.view(num_tokens, num_groups, per_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if correction_bias is not None else grouped.amax(-1)
        groups = group_scores.topk(topk_groups, dim=-1).indices
        allowed = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=logits.device)
        allowed.scatter_(1, groups, True)
        chosen_by = chosen_by.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    limit = num_experts if num_groups is None else topk_groups * (num_experts // num_groups)
    if top_k > limit:
        bad_argument(op, "top_k", f"at most {limit} (the experts a token can reach)", top_k)
    topk_idx = chosen_by.topk(top_k, dim=-1).indices
    weights = scores.gather(1, topk_idx)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return topk_idx, (weights * scaling_factor).to(torch.float32)
