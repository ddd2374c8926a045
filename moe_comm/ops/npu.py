"""The ops on Ascend NPUs through ``torch_npu``'s fused MoE operators, where they compute what the op
specifies: ``permute`` (no alignment padding, bf16/fp16 or dynamic INT8) as ``npu_moe_init_routing_v2``,
the contiguous-layout ``grouped_gemm`` (bf16/fp16) as ``npu_grouped_matmul``. The other forms take the
torch path on NPU tensors too. Argument mapping and output conversion follow the operators'
documentation (``docs/vendors.md``, ops on NPU tensors); the tests hold them to the references through a
CPU model of the operators, and ``pytest -m ascend`` on an NPU.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch

from ..core.vendor_imports import load
from .quant import quantize_reference

__all__ = ["torch_npu_for", "permute_npu", "grouped_gemm_npu"]

#: the modes of npu_moe_init_routing_v2's quant_mode this op maps to: none, dynamic INT8 per row
_QUANT_MODE = {None: -1, "int8": 1}


def torch_npu_for(tensor: torch.Tensor) -> Optional[ModuleType]:
    """``torch_npu`` when ``tensor`` lives on an NPU and the module imports, else None."""
    if tensor.device.type != "npu":
        return None
    return load("torch_npu", "Huawei's Ascend Extension for PyTorch")[0]


def permute_npu(torch_npu: ModuleType, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                quant: Optional[str], size: Callable[[torch.Tensor], int]) -> tuple:
    """``permute``'s fields (x, scales, expert_offsets, num_tokens_per_expert, row_of, source,
    expert_of_row) from ``npu_moe_init_routing_v2``: rows sorted by expert, each expert's in flat
    ``t * K + k`` order; ``-1`` entries (outside ``active_expert_range``) dropped. ``quant``: None or
    ``"int8"``; no alignment. ``size(expert_offsets)``: the rows of the outputs (``permute``'s ``num_rows``)."""
    num_tokens, num_topk = topk_idx.shape
    expanded_x, expanded_row_idx, counts, expanded_scale = torch_npu.npu_moe_init_routing_v2(
        x, topk_idx.to(torch.int32), active_num=num_tokens * num_topk, expert_num=num_experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=_QUANT_MODE[quant],
        active_expert_range=[0, num_experts], row_idx_type=0)
    per_expert = counts.to(torch.int64)
    offsets = torch.cat([per_expert.new_zeros(1), per_expert.cumsum(0)])
    routed, rows = int(offsets[-1]), size(offsets)
    device = x.device
    source = torch.full((rows,), -1, dtype=torch.int64, device=device)
    source[:routed] = expanded_row_idx[:routed].to(torch.int64)  # gather-style: each row's flat (t, k)
    row_of = torch.full((num_tokens * num_topk,), -1, dtype=torch.int64, device=device)
    row_of[source[:routed]] = torch.arange(routed, device=device)
    expert_of_row = torch.full((rows,), -1, dtype=torch.int32, device=device)
    expert_of_row[:routed] = torch.repeat_interleave(torch.arange(num_experts, dtype=torch.int32, device=device),
                                                     per_expert)
    out = torch.zeros(rows, x.shape[1], dtype=expanded_x.dtype, device=device)
    out[:routed] = expanded_x[:routed]
    scales = None
    if quant is not None:  # padding rows: a zero row's codes and scale, as permute's other paths give
        scales = quantize_reference(torch.zeros(1, x.shape[1], device=device), quant)[1].reshape(1).repeat(rows)
        scales[:routed] = expanded_scale[:routed]
    return (out, scales, offsets, per_expert.to(torch.int32), row_of.view(num_tokens, num_topk), source,
            expert_of_row)


def grouped_gemm_npu(torch_npu: ModuleType, a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor,
                     ends: torch.Tensor, out: torch.Tensor) -> None:
    """``out[rows of e] = a[rows of e] @ b[e].T`` for back-to-back expert segments (the contiguous layout:
    ``ends[e] == starts[e + 1]``), as one ``npu_grouped_matmul`` (weights ``[E, K, N]``, per-group row
    counts). Rows outside the segments stay as they are."""
    counts = (ends - starts).to(torch.int64)
    first, last = (int(starts[0]), int(ends[-1])) if ends.numel() else (0, 0)
    if last == first:
        return
    result = torch_npu.npu_grouped_matmul([a[first:last]], [b.transpose(1, 2)], group_list=counts, split_item=3,
                                          group_type=0, group_list_type=1, output_dtype=out.dtype)
    out[first:last] = result[0]
