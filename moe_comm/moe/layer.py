"""``EPMoE``: an expert-parallel MoE layer on a ``Buffer``, and ``ep_moe``, its functional form."""
from __future__ import annotations

from typing import Optional

import torch

from ..buffer import Buffer
from ..core.checks import check_int, check_tensor, describe
from ..core.errors import bad_argument
from ..ops.impl import renamed_impl
from . import schedules
from .experts import Experts
from .routing import select_experts

__all__ = ["EPMoE", "ep_moe"]


def _check_forward(op: str, buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   experts: Experts, num_experts: int, mode: str, num_chunks: int,
                   num_max_dispatch_tokens_per_rank: Optional[int]) -> None:
    if not isinstance(buffer, Buffer):
        bad_argument(op, "buffer", "a moe_comm.Buffer", describe(buffer), kind=TypeError)
    if not isinstance(experts, Experts):
        bad_argument(op, "experts", "a moe_comm.moe.Experts", describe(experts), kind=TypeError)
    if mode not in schedules.MODES:
        bad_argument(op, "mode", f"one of {list(schedules.MODES)}", repr(mode))
    check_int(op, "num_chunks", num_chunks, minimum=1)
    check_int(op, "num_experts", num_experts, minimum=1)
    ranks = buffer.group_size
    if num_experts % ranks or num_experts // ranks != experts.num_experts:
        bad_argument(op, "num_experts", f"the group size ({ranks}) times this rank's {experts.num_experts} experts",
                     num_experts)
    check_tensor(op, "x", x, shape=(None, experts.hidden), dtype=torch.bfloat16)
    check_tensor(op, "topk_idx", topk_idx, shape=(x.shape[0], None), dtype=torch.int64, device=x.device)
    check_tensor(op, "topk_weights", topk_weights, shape=tuple(topk_idx.shape), dtype=torch.float32, device=x.device)
    if experts.w13.device != x.device:
        bad_argument(op, "experts", f"weights on x's device {x.device}", describe(experts.w13))
    if mode in schedules.LOW_LATENCY_MODES:
        if not buffer.low_latency_mode:
            bad_argument(op, "buffer", f"a Buffer with low_latency_mode=True for mode {mode!r}",
                         "a Buffer with low_latency_mode=False")
        if num_max_dispatch_tokens_per_rank is None:
            bad_argument(op, "num_max_dispatch_tokens_per_rank", f"an int for mode {mode!r}", None)
        m = check_int(op, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        count = schedules.num_micro_batches(mode, num_chunks)
        if -(-x.shape[0] // count) > m:
            bad_argument(op, "x", f"[T, H] with T <= {m * count} in mode {mode!r} ({count} micro-batch(es) of at most "
                         f"num_max_dispatch_tokens_per_rank={m} tokens)", describe(x))


def ep_moe(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
           num_experts: int, *, mode: str = "sequential", num_chunks: int = 2,
           num_max_dispatch_tokens_per_rank: Optional[int] = None, ops_impl: Optional[str] = None,
           backend: Optional[str] = None) -> torch.Tensor:
    """One expert-parallel MoE forward over ``buffer``'s group. Collective: every rank calls it with the
    same ``mode``, ``num_chunks`` and ``num_experts``.

    Args:
        x: `[T, H]` bf16 tokens of this rank (T may differ between ranks, and be 0).
        topk_idx: `[T, K]` int64 global expert ids or -1; expert e lives on rank ``e // E_loc``.
        topk_weights: `[T, K]` float32.
        experts: this rank's ``E_loc = num_experts / group size`` experts.
        mode: ``sequential`` (normal dispatch, experts, combine), ``chunked`` (normal mode over
            ``num_chunks`` pipelined micro-batches), ``two_batch`` (low-latency with two micro-batches
            overlapped through receive hooks) or ``low_latency`` (one low-latency batch, for decode). The
            low-latency modes need a ``Buffer(low_latency_mode=True)`` sized for
            ``num_max_dispatch_tokens_per_rank`` tokens per micro-batch; FP8 experts get FP8 dispatch.
        ops_impl: the implementation of the ops (``impl=`` of ``moe_comm.ops``: ``native`` or ``triton``;
            None: ``moe_comm.ops.resolve`` picks). ``backend`` is its deprecated old name.
    Returns:
        `[T, H]` bf16: ``out[t] = sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t])`` over slots with
        ``topk_idx >= 0``, summed in fp32, bit for bit ``ep_moe_reference`` (normal modes round each rank's
        share to bf16 before the fp32 sum over ranks).
    """
    _check_forward("ep_moe", buffer, x, topk_idx, topk_weights, experts, num_experts, mode, num_chunks,
                   num_max_dispatch_tokens_per_rank)
    ops_impl = renamed_impl("ep_moe", "ops_impl", ops_impl, backend)
    stages = schedules.stages_for(mode, buffer, experts, num_experts, num_max_dispatch_tokens_per_rank, ops_impl)
    return schedules.run(mode, stages, x, topk_idx, topk_weights, num_chunks)


class EPMoE(torch.nn.Module):
    """An expert-parallel MoE layer (forward only): routes, dispatches, runs this rank's experts and
    combines, over ``buffer``'s group. Holds the experts as buffers (``w13``, ``w2`` and, for FP8, their
    block scales); ``forward`` takes ``topk_idx``/``topk_weights`` or ``router_logits``.

    Args:
        buffer: the group's ``moe_comm.Buffer`` (``low_latency_mode=True`` for the low-latency modes).
        experts: this rank's experts (``Experts(...).select(rank * E_loc, E_loc)`` of a global set).
        num_experts: experts over the whole group.
        top_k, scoring, num_groups, topk_groups, renormalize, scaling_factor: routing from logits
            (``select_experts``); ``correction_bias`` `[num_experts]` is kept as a buffer.
        mode, num_chunks, num_max_dispatch_tokens_per_rank, ops_impl, backend: as ``ep_moe``.
    """

    def __init__(self, buffer: Buffer, experts: Experts, num_experts: int, *, top_k: Optional[int] = None,
                 scoring: str = "softmax", num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
                 correction_bias: Optional[torch.Tensor] = None, renormalize: bool = False,
                 scaling_factor: float = 1.0, mode: str = "sequential", num_chunks: int = 2,
                 num_max_dispatch_tokens_per_rank: Optional[int] = None, ops_impl: Optional[str] = None,
                 backend: Optional[str] = None) -> None:
        super().__init__()
        if mode not in schedules.MODES:
            bad_argument("EPMoE", "mode", f"one of {list(schedules.MODES)}", repr(mode))
        self.buffer, self.num_experts = buffer, num_experts
        self.routing = dict(top_k=top_k, scoring=scoring, num_groups=num_groups, topk_groups=topk_groups,
                            renormalize=renormalize, scaling_factor=scaling_factor)
        self.mode, self.num_chunks = mode, num_chunks
        self.ops_impl = renamed_impl("EPMoE", "ops_impl", ops_impl, backend)
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        for name in ("w13", "w2", "w13_scales", "w2_scales"):
            self.register_buffer(name, getattr(experts, name))
        self.register_buffer("correction_bias", correction_bias)

    @property
    def experts(self) -> Experts:
        """This rank's experts, from the module's (possibly moved) buffers."""
        return Experts(self.w13, self.w2, self.w13_scales, self.w2_scales)

    def forward(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None, *,
                router_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`[T, H]` bf16 MoE output for ``x`` `[T, H]` bf16, routed by ``topk_idx``/``topk_weights`` or by
        ``router_logits`` `[T, num_experts]` (exactly one of the two). Collective (see ``ep_moe``)."""
        if (router_logits is None) == (topk_idx is None and topk_weights is None):
            bad_argument("EPMoE.forward", "routing", "either topk_idx and topk_weights, or router_logits",
                         f"topk_idx={describe(topk_idx)}, topk_weights={describe(topk_weights)}, "
                         f"router_logits={describe(router_logits)}")
        if router_logits is not None:
            if self.routing["top_k"] is None:
                bad_argument("EPMoE.forward", "router_logits", "used only by an EPMoE built with top_k",
                             describe(router_logits))
            check_tensor("EPMoE.forward", "router_logits", router_logits, shape=(x.shape[0], self.num_experts))
            topk_idx, topk_weights = select_experts(router_logits, correction_bias=self.correction_bias,
                                                    **self.routing)
        with torch.no_grad():
            return ep_moe(self.buffer, x, topk_idx, topk_weights, self.experts, self.num_experts, mode=self.mode,
                          num_chunks=self.num_chunks,
                          num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
                          ops_impl=self.ops_impl)
