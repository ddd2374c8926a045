"""Checks of low-latency arguments (DeepEP's ``low_latency_dispatch`` / ``low_latency_combine``) and
DeepEP's low-latency buffer size, which a ``Buffer`` must have been given."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..core.checks import check_int, check_tensor, describe
from ..core.errors import bad_argument
from ..core.limits import MAX_INT32, check_count, check_fits
from ..ops.fp8 import GROUP
from ..protocol.codes import Fp8Format
from ..protocol.handle import LowLatencyHandle
from ..ops.layout import topk_summary
from .normal_args import check_topk_idx, check_topk_ids

__all__ = ["low_latency_buffer_bytes", "check_ll_dispatch", "check_ll_combine", "check_ll_sizes",
           "check_ll_counts", "check_rdma_bytes",
           "LowLatencyDispatchArgs"]


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """DeepEP's ``LowLatencyLayout.total_bytes``: two buffers, each a send area, a receive area and
    signals, sized for BF16 or FP8 dispatch messages and BF16 combine messages (before rounding)."""
    m, h, e = num_max_dispatch_tokens_per_rank, hidden, num_experts
    scales = h // GROUP
    dispatch_msg = 16 + max(2 * h, h + 4 * scales)
    combine_msg = 4 * scales + 2 * h
    send = max(m * dispatch_msg, e * m * combine_msg)
    recv = max(e * m * dispatch_msg, e * m * combine_msg)
    signal = -(-4 * e // 128) * 128
    return 2 * (send + recv + signal)


def check_ll_counts(op: str, num_max_dispatch_tokens_per_rank: Any, num_experts: Any, num_ranks: int) -> None:
    """M >= 1 and the experts a positive multiple of the group size."""
    check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
    check_count(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank,
                f"the num_ranks * M = {num_ranks} * M rows of an expert's block are numbered with int32",
                limit=MAX_INT32 // num_ranks)
    check_int(op, "num_experts", num_experts, minimum=1)
    if num_experts % num_ranks:
        bad_argument(op, "num_experts", f"a multiple of the group size {num_ranks}", num_experts)
    check_count(op, "num_experts", num_experts, "experts are numbered with int32 in counts and records")


def check_rdma_bytes(op: str, m: int, hidden: int, num_experts: int, num_ranks: int, num_rdma_bytes: int) -> None:
    """The Buffer's ``num_rdma_bytes`` holds DeepEP's low-latency layout for these (checked) sizes,
    as DeepEP asserts."""
    need = low_latency_buffer_bytes(m, hidden, num_experts)
    if num_rdma_bytes < need:
        bad_argument(op, "the Buffer's num_rdma_bytes",
                     f">= {need} for num_max_dispatch_tokens_per_rank={m}, hidden={hidden}, num_experts={num_experts} "
                     f"(create it with num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint({m}, {hidden}, "
                     f"{num_ranks}, {num_experts}))", num_rdma_bytes)


def check_ll_sizes(op: str, num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any, num_ranks: int,
                   num_rdma_bytes: int) -> None:
    """``check_ll_counts``, hidden a positive multiple of 128, and ``check_rdma_bytes``."""
    check_ll_counts(op, num_max_dispatch_tokens_per_rank, num_experts, num_ranks)
    check_int(op, "hidden", hidden, minimum=GROUP)
    if hidden % GROUP:
        bad_argument(op, "hidden", f"a multiple of {GROUP}", hidden)
    check_rdma_bytes(op, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_ranks, num_rdma_bytes)


def _check_ll_topk(op: str, topk_idx: Any, num_experts: int, m: int, num_tokens: Optional[int],
                   device: torch.device, values: bool) -> torch.Tensor:
    """``[T, K]`` int64, T <= M, K <= num_experts, and with ``values`` (read on the host) ids in [-1, E),
    no expert twice in a row."""
    topk_idx = check_topk_idx(op, topk_idx, num_experts, num_tokens, device, values=False)
    summary = topk_summary(topk_idx) if values and topk_idx.numel() else None
    if summary is not None:
        check_topk_ids(op, summary, num_experts)
    if topk_idx.shape[0] > m:
        bad_argument(op, "topk_idx", f"at most num_max_dispatch_tokens_per_rank = {m} rows", describe(topk_idx))
    if topk_idx.shape[1] > num_experts:
        bad_argument(op, "topk_idx", f"at most num_experts = {num_experts} columns", describe(topk_idx))
    if summary is not None and summary[2] >= 0:
        bad_argument(op, "topk_idx", "rows that pick each expert at most once",
                     f"row {summary[2]} picking expert {summary[3]} twice")
    return topk_idx


@dataclass(frozen=True)
class LowLatencyDispatchArgs:
    x: torch.Tensor
    topk_idx: torch.Tensor
    fp8_format: Fp8Format


def _check_stats(op: str, name: str, stats: Any, size: int, dtype: torch.dtype, device: torch.device) -> None:
    if stats is not None:
        check_tensor(op, name, stats, shape=(size,), dtype=dtype, device=device)


def check_ll_dispatch(op: str, x: Any, topk_idx: Any, m: int, num_experts: int, num_ranks: int,
                      recv_stats: Any, wait_stats: Any, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                      topk_values: bool = True) -> LowLatencyDispatchArgs:
    """Checks ``low_latency_dispatch`` tensors (sizes and flags are checked already; the top-k ids
    only with ``topk_values``)."""
    check_tensor(op, "x", x, shape=(None, None), dtype=torch.bfloat16)
    hidden = x.shape[1]
    if hidden % GROUP or hidden < GROUP:
        bad_argument(op, "x", f"[T, hidden] with hidden a positive multiple of {GROUP}", describe(x))
    if x.shape[0] > m:
        bad_argument(op, "x", f"at most num_max_dispatch_tokens_per_rank = {m} rows", describe(x))
    topk_idx = _check_ll_topk(op, topk_idx, num_experts, m, x.shape[0], x.device, topk_values)
    local, rows = num_experts // num_ranks, num_ranks * m
    # recv_x (bf16, or fp8 plus fp32 scales) and src_info (int32) for every row of every local expert
    row_bytes = (hidden + 4 * (hidden // GROUP) if use_fp8 else 2 * hidden) + 4
    check_fits(op, "num_max_dispatch_tokens_per_rank", m, local * rows * row_bytes, x.device,
               f"the [{local}, {rows}, {hidden}] receive buffer")
    _check_stats(op, "cumulative_local_expert_recv_stats", recv_stats, num_experts // num_ranks, torch.int32,
                 x.device)
    _check_stats(op, "dispatch_wait_recv_cost_stats", wait_stats, num_ranks, torch.int64, x.device)
    if use_fp8 and use_ue8m0:
        if not round_scale:
            bad_argument(op, "round_scale", "True when use_ue8m0=True (UE8M0 holds power-of-two scales only)",
                         round_scale)
        if hidden % (4 * GROUP):
            bad_argument(op, "x", f"[T, hidden] with hidden a multiple of {4 * GROUP} for use_ue8m0 (4 scales "
                         f"per int32)", describe(x))
    return LowLatencyDispatchArgs(x, topk_idx, Fp8Format.of(use_fp8, round_scale, use_ue8m0))


def check_ll_combine(op: str, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, num_ranks: int,
                     out: Any, wait_stats: Any, topk_values: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LowLatencyHandle]:
    """Checks ``low_latency_combine`` tensors (the top-k ids only with ``topk_values``); returns (x,
    topk_idx, topk_weights, handle)."""
    if not isinstance(x, torch.Tensor):
        bad_argument(op, "x", "a tensor", describe(x), kind=TypeError)
    parsed = LowLatencyHandle.from_tuple(op, handle, num_ranks, x.device, topk_values)
    m, hidden = parsed.num_max_dispatch_tokens_per_rank, parsed.hidden
    local = parsed.num_experts // num_ranks
    check_tensor(op, "x", x, shape=(local, num_ranks * m, hidden), dtype=torch.bfloat16)
    topk_idx = _check_ll_topk(op, topk_idx, parsed.num_experts, m, None, x.device, topk_values)
    num_tokens, num_topk = topk_idx.shape
    check_tensor(op, "topk_weights", topk_weights, shape=(num_tokens, num_topk), dtype=torch.float32, device=x.device)
    if out is not None:
        check_tensor(op, "out", out, shape=(num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
        if not out.is_contiguous():
            bad_argument(op, "out", "contiguous", f"strides {out.stride()}")
    _check_stats(op, "combine_wait_recv_cost_stats", wait_stats, num_ranks, torch.int64, x.device)
    return x, topk_idx, topk_weights, parsed
