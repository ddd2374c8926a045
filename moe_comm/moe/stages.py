"""The three steps of an EP-MoE forward over one ``Buffer``, in each mode's layout:

    dispatch   tokens to the ranks of their experts (communication; may run in the background)
    compute    this rank's experts on what arrived (local)
    combine    the expert outputs back to their tokens (communication; may run in the background)

The schedules (``schedules.py``) order these steps; the benchmark times them one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..buffer.buffer import Buffer
from ..buffer.event import EventOverlap
from ..ops import permute, quantize, take_rows, unpermute_reduce
from .experts import Experts

__all__ = ["local_expert_rows", "NormalStages", "NormalReceived", "LowLatencyStages", "LowLatencyReceived"]


def local_expert_rows(experts: Experts, x: torch.Tensor, local_idx: torch.Tensor, weights: torch.Tensor,
                      scales: Optional[torch.Tensor] = None, impl: Optional[str] = None) -> torch.Tensor:
    """``experts`` on normal-mode rows ``x`` `[N, H]` (bf16, or E4M3 with ``scales`` `[N, H / 128]`), routed by
    ``local_idx`` `[N, K]` (ids into ``experts``, -1 for a slot elsewhere): `[N, H]` bf16, each row
    ``bf16(sum over its local slots k ascending of weights[n, k] * y_k)`` in fp32; a row without local slots is 0."""
    perm = permute(x, local_idx, experts.num_experts, impl=impl)
    perm_scales = None
    if scales is not None:
        perm_scales = scales.new_empty(perm.x.shape[0], scales.shape[1])
        num_topk = local_idx.shape[1]
        take_rows(perm_scales, scales, torch.where(perm.source >= 0, perm.source // num_topk, -1))
    y = experts.ffn(perm.x, expert_offsets=perm.expert_offsets, x_scales=perm_scales, impl=impl)
    return unpermute_reduce(y, perm.row_of, weights, impl=impl)


@dataclass
class NormalReceived:
    """A normal-mode dispatch: rows by source rank, top-k slots as local expert ids or -1."""

    x: torch.Tensor                   # [N, H] bf16, or float8_e4m3fn with FP8 experts
    scales: Optional[torch.Tensor]    # [N, H / 128] fp32 with FP8 experts
    topk_idx: torch.Tensor            # [N, K] int64
    topk_weights: torch.Tensor        # [N, K] fp32, 0 where topk_idx is -1
    handle: tuple
    event: EventOverlap               # holds an event when dispatched with async_finish

    def wait(self) -> None:
        """Makes the received tensors ready (a no-op unless dispatched with ``async_finish``)."""
        if self.event.event is not None:
            self.event.current_stream_wait()


class NormalStages:
    """Normal (high-throughput) mode: ``Buffer.dispatch`` / ``Buffer.combine``, with each rank's share
    of a token reduced over its own top-k slots before the combine sums the ranks.

    Per token, the result is ``bf16(sum over ranks r ascending of bf16(sum over slots k ascending whose
    expert lives on r of w_k * y_k))``, every sum in fp32 (``reference.dense_moe`` with rank groups)."""

    def __init__(self, buffer: Buffer, experts: Experts, num_experts: int, impl: Optional[str] = None) -> None:
        self.buffer, self.experts, self.num_experts, self.impl = buffer, experts, num_experts, impl

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 async_finish: bool = False) -> NormalReceived:
        """Sends ``x`` `[T, H]` bf16 (as E4M3 with per-128-channel scales for FP8 experts); collective."""
        data = quantize(x, "e4m3", impl=self.impl) if self.experts.fp8 else x
        recv, recv_idx, recv_weights, _, handle, event = self.buffer.dispatch(
            data, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=self.num_experts,
            async_finish=async_finish)
        recv_x, recv_scales = recv if self.experts.fp8 else (recv, None)
        return NormalReceived(recv_x, recv_scales, recv_idx, recv_weights, handle, event)

    def compute(self, received: NormalReceived) -> torch.Tensor:
        """This rank's experts on the received rows (waits for them first): `[N, H]` bf16, each row the
        weighted sum over its local slots."""
        received.wait()
        return local_expert_rows(self.experts, received.x, received.topk_idx, received.topk_weights, received.scales,
                                 impl=self.impl)

    def combine(self, partial: torch.Tensor, received: NormalReceived,
                async_finish: bool = False) -> tuple[torch.Tensor, EventOverlap]:
        """Sums every rank's rows for each of this rank's tokens: (`[T, H]` bf16, event); collective."""
        out, _, event = self.buffer.combine(partial, received.handle, async_finish=async_finish)
        return out, event


@dataclass
class LowLatencyReceived:
    """A low-latency dispatch: per local expert, a fixed block of ``R * M`` rows."""

    x: torch.Tensor                   # [E_loc, R * M, H] bf16 or float8_e4m3fn
    scales: Optional[torch.Tensor]    # [E_loc, R * M, H / 128] fp32 with FP8 experts
    count: torch.Tensor               # [E_loc] int32 valid rows per block
    handle: tuple
    topk_idx: torch.Tensor            # this rank's routing, which the combine needs again
    topk_weights: torch.Tensor
    hook: Optional[Callable[[], None]]  # the receive, when dispatched with a hook

    def wait(self) -> None:
        """Receives (runs the hook) unless that already happened."""
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


class LowLatencyStages:
    """Low-latency mode: ``Buffer.low_latency_dispatch`` / ``low_latency_combine`` (FP8 dispatch for FP8
    experts), the experts on the masked layout, and a weighted combine. Per token the result is
    ``bf16(sum over slots k ascending of w_k * y_k)`` in fp32 (``reference.dense_moe``)."""

    def __init__(self, buffer: Buffer, experts: Experts, num_experts: int, num_max_dispatch_tokens_per_rank: int,
                 impl: Optional[str] = None) -> None:
        self.buffer, self.experts, self.num_experts, self.impl = buffer, experts, num_experts, impl
        self.m = num_max_dispatch_tokens_per_rank

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 hook: bool = False) -> LowLatencyReceived:
        """Sends ``x`` `[T <= M, H]` bf16; with ``hook`` only sends (``received.wait()`` receives)."""
        recv, count, handle, _, recv_hook = self.buffer.low_latency_dispatch(
            x, topk_idx, self.m, self.num_experts, use_fp8=self.experts.fp8, return_recv_hook=hook)
        recv_x, recv_scales = recv if self.experts.fp8 else (recv, None)
        return LowLatencyReceived(recv_x, recv_scales, count, handle, topk_idx, topk_weights, recv_hook)

    def compute(self, received: LowLatencyReceived) -> torch.Tensor:
        """This rank's experts on their blocks (receives first): `[E_loc, R * M, H]` bf16."""
        received.wait()
        return self.experts.ffn(received.x, masked_m=received.count, x_scales=received.scales, impl=self.impl)

    def combine(self, y: torch.Tensor, received: LowLatencyReceived,
                hook: bool = False) -> tuple[torch.Tensor, Optional[Callable[[], None]]]:
        """Weighted sum of every slot's expert output per token: (`[T, H]` bf16, the receive hook or None);
        with ``hook`` the output is filled only when the hook is called."""
        out, _, recv_hook = self.buffer.low_latency_combine(y, received.topk_idx, received.topk_weights,
                                                            received.handle, return_recv_hook=hook)
        return out, recv_hook
