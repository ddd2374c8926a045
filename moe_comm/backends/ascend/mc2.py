"""Ascend's MC2 low-latency operators as the ascend backend calls them: which product and version,
the communicator, the documented limits (``csrc/ascend/mc2_limits.cpp`` through ``moe_comm._C``), and
the argument mapping of ``npu_moe_distribute_dispatch(_v2)`` / ``npu_moe_distribute_combine(_v2)``.

Every rank pads its tokens to ``num_max_dispatch_tokens_per_rank`` rows, so all ranks send the same
batch (``global_bs = M * R``), and drops what DeepEP drops (top-k entries of -1, experts of masked ranks,
the padding) through the 2-D ``x_active_mask`` (v2). The operators' bookkeeping (``assist_info_for_combine``
or ``expand_idx``, ``ep_recv_counts``, ``tp_recv_counts``) is opaque and is passed back unread.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...core import env
from ...core.native import native

__all__ = ["Mc2", "Mc2Routing", "product_of"]

# Atlas A2 NPUs report names "Ascend910B1".."Ascend910B4"; Atlas A3 "Ascend910_9391" and kin.
_PRODUCTS = (("910B", "A2"), ("910_93", "A3"))


def product_of(device_name: str) -> Optional[str]:
    """``"A2"`` / ``"A3"`` for an NPU's device name, None for a chip MC2's EP operators do not serve."""
    return next((product for marker, product in _PRODUCTS if marker in device_name), None)


@dataclass
class Mc2Routing:
    """What one MC2 dispatch hands its combine: the padded expert ids, mask and weights' batch, the
    operators' opaque tensors, and the per-expert row counts of ``expand_x``."""

    expert_ids: torch.Tensor      # [M, K] int32, every entry a valid expert (inactive ones masked)
    active: torch.Tensor          # [M, K] bool: the 2-D x_active_mask
    assist: torch.Tensor          # assist_info_for_combine (v2) or expand_idx (v1)
    ep_recv_counts: torch.Tensor
    tp_recv_counts: torch.Tensor
    counts: list[int]             # expert_token_nums: rows of each local expert in expand_x
    recv_rows: int                # rows of expand_x (the operators' A)


class Mc2:
    """One Buffer's MC2 calls: the NPU product, the operator version (v2 where ``torch_npu`` has it),
    the HCCL communicator of the group the Buffer reserves for them."""

    def __init__(self, torch_npu: ModuleType, group: dist.ProcessGroup, device_type: str) -> None:
        self.npu = torch_npu
        self.version = 2 if hasattr(torch_npu, "npu_moe_distribute_dispatch_v2") else 1
        self.device_name = torch_npu.npu.get_device_name(0)
        self.product = product_of(self.device_name)
        self.comm_alg = env.ascend_comm_alg() if self.version == 2 else ""
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        # HCCL keeps one communicator per group; MC2 must have it to itself (the documented rule), so the
        # Buffer gives MC2 a group of its own, made by its members only.
        self.group = dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                                    use_local_synchronization=True)
        backend = self.group._get_backend(torch.device(device_type))
        self.comm_name = backend.get_hccl_comm_name(dist.get_rank())

    def _args(self, num_experts: int, hidden: int, batch: int, topk: int, quant: bool) -> tuple:
        return (self.product, self.version, self.comm_alg, self.num_ranks, num_experts, hidden, batch, topk, quant)

    def check(self, op: str, num_experts: int, hidden: int, batch: int, topk: int, quant: bool) -> None:
        """ValueError naming the argument when MC2 (or ``HCCL_BUFFSIZE``) would refuse this call's shape."""
        if self.product is None:
            raise ValueError(f"{op}: the ascend backend's low-latency mode runs MC2's EP operators, which serve "
                             f"Atlas A2 (Ascend910B*) and Atlas A3 (Ascend910_93*); this NPU is {self.device_name!r}")
        args = self._args(num_experts, hidden, batch, topk, quant)
        wrong = native().mc2_check(*args)
        if wrong:
            raise ValueError(f"{op}: the ascend backend's MC2 operators refuse this call: {wrong}")
        need, have = native().mc2_min_buffsize_mb(*args), env.hccl_buffsize_mb()
        if have < need:
            raise ValueError(f"{op}: HCCL_BUFFSIZE must be at least {need} (MB) for MC2 at {self.num_ranks} ranks, "
                             f"{num_experts} experts, hidden {hidden}, {batch} tokens per rank and top-{topk}, "
                             f"got {have}")

    def _common(self, num_experts: int, global_bs: int) -> dict[str, Any]:
        kw: dict[str, Any] = dict(group_ep=self.comm_name, ep_world_size=self.num_ranks, ep_rank_id=self.rank,
                                  moe_expert_num=num_experts, global_bs=global_bs)
        if self.product == "A3":  # A3 takes the TP domain's arguments even without one
            kw.update(group_tp=self.comm_name, tp_world_size=1, tp_rank_id=0)
        if self.version == 2:
            kw["comm_alg"] = self.comm_alg
        return kw

    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, active: torch.Tensor, num_experts: int,
                 quant: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], Mc2Routing]:
        """MC2 dispatch of padded ``x`` [M, H] bf16: (expand_x [A, H] bf16 or int8 with rows grouped by local
        expert, dynamic_scales [A] fp32 or None, the routing its combine needs)."""
        kw = self._common(num_experts, x.shape[0] * self.num_ranks)
        kw.update(quant_mode=2 if quant else 0, expert_token_nums_type=1)
        if self.version == 2:
            kw["x_active_mask"] = active
            out = self.npu.npu_moe_distribute_dispatch_v2(x, expert_ids, **kw)
        else:
            out = self.npu.npu_moe_distribute_dispatch(x, expert_ids, **kw)
        expand_x, scales, assist, token_nums, ep_counts, tp_counts = out[:6]
        routing = Mc2Routing(expert_ids, active, assist, ep_counts, tp_counts, token_nums.tolist(), expand_x.shape[0])
        return expand_x, scales if quant else None, routing

    def combine(self, expand_x: torch.Tensor, weights: torch.Tensor, routing: Mc2Routing, num_experts: int
                ) -> torch.Tensor:
        """MC2 combine of ``expand_x`` [A, H] bf16 (rows as the dispatch grouped them): [M, H] bf16, each
        token's active rows weighted by ``weights`` [M, K] fp32 and summed."""
        kw = self._common(num_experts, routing.expert_ids.shape[0] * self.num_ranks)
        kw["tp_send_counts"] = routing.tp_recv_counts
        if self.version == 2:
            kw["x_active_mask"] = routing.active
            return self.npu.npu_moe_distribute_combine_v2(expand_x, routing.expert_ids, routing.assist,
                                                          routing.ep_recv_counts, weights, **kw)
        return self.npu.npu_moe_distribute_combine(expand_x, routing.expert_ids, routing.assist,
                                                   routing.ep_recv_counts, weights, **kw)
