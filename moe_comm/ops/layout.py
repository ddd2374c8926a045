"""Routing histograms for normal-mode dispatch (DeepEP's ``get_dispatch_layout``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core.library import define, op
from ..core.native import cpu_threads, native
from .impl import kernels, next_pow2, renamed_impl, resolve
from .rows import check_index

__all__ = ["DispatchLayout", "dispatch_layout", "dispatch_layout_reference", "SendPlan", "plan_sends", "token_channels",
           "topk_summary", "topk_summary_reference"]

_BLOCK_T = 128


def topk_summary(topk_idx: torch.Tensor) -> tuple[int, int, int, int]:
    """What the argument checks read of ``topk_idx`` `[T, K]` int64, in one pass on the CPU: (smallest id,
    largest id, the first row that picks an expert >= 0 twice, the smallest such expert); (0, 0) when
    empty, (-1, -1) when no row repeats one. Reference: ``topk_summary_reference``."""
    if topk_idx.device.type != "cpu":
        return topk_summary_reference(topk_idx)
    topk_idx = topk_idx.contiguous()
    return native().topk_summary(topk_idx.data_ptr(), topk_idx.shape[0], topk_idx.shape[1])


def topk_summary_reference(topk_idx: torch.Tensor) -> tuple[int, int, int, int]:
    """Plain-torch specification of ``topk_summary``; also the path for non-CPU devices."""
    if not topk_idx.numel():
        return 0, 0, -1, -1
    ordered = topk_idx.sort(dim=1).values
    repeat = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if not bool(repeat.any()):
        return lo, hi, -1, -1
    t, k = (int(i) for i in repeat.nonzero()[0])
    return lo, hi, t, int(ordered[t, k])


@dataclass(frozen=True)
class DispatchLayout:
    """Where each token goes. Experts map to ranks in contiguous blocks: ``rank = e // (E / R)``."""

    # num_tokens_per_rank[r] = #{t : token t picked at least one expert of rank r}   [R] int32
    num_tokens_per_rank: torch.Tensor
    # num_tokens_per_expert[e] = #{(t, k) : topk_idx[t, k] == e}                      [E] int32
    num_tokens_per_expert: torch.Tensor
    # is_token_in_rank[t, r] = token t picked at least one expert of rank r           [T, R] bool
    is_token_in_rank: torch.Tensor

    def __post_init__(self) -> None:
        assert self.num_tokens_per_rank.dtype == torch.int32
        assert self.num_tokens_per_expert.dtype == torch.int32
        assert self.is_token_in_rank.dtype == torch.bool

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three tensors, in declaration order."""
        return self.num_tokens_per_rank, self.num_tokens_per_expert, self.is_token_in_rank


def dispatch_layout(topk_idx: torch.Tensor, num_ranks: int, num_experts: int, *, impl: Optional[str] = None,
                    backend: Optional[str] = None
                    ) -> DispatchLayout:
    """Histograms of ``topk_idx``. Local; no communication.

    Args:
        topk_idx: `[num_tokens, num_topk]` int64, contiguous, ids in [0, num_experts) or -1 (skipped);
            on the ``_C`` and torch paths another id is a ValueError naming it.
        num_ranks: ranks of the group; ``num_experts % num_ranks == 0``.
    Returns:
        DispatchLayout on ``topk_idx``'s device; counts are exact (a token counts once per rank).
    Reference: ``dispatch_layout_reference`` (tests compare exactly). Backends: ``_C`` on CPU, torch ops
    on other devices, or the Triton kernel.
    """
    _check_layout(topk_idx, num_ranks, num_experts)
    return DispatchLayout(*op("dispatch_layout")(topk_idx, num_ranks, num_experts,
                                                 renamed_impl("dispatch_layout", "impl", impl, backend)))


def _check_layout(topk_idx: torch.Tensor, num_ranks: int, num_experts: int) -> None:
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError(f"dispatch_layout: topk_idx must be a 2-D tensor [num_tokens, num_topk], got "
                         f"{list(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}")
    for name, value in (("num_ranks", num_ranks), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"dispatch_layout: {name} must be a positive int, got {value!r}")
    if num_experts % num_ranks:
        raise ValueError(f"dispatch_layout: num_experts must be a multiple of num_ranks ({num_ranks}), got "
                         f"{num_experts}")


def _dispatch_layout_fake(topk_idx: torch.Tensor, num_ranks: int, num_experts: int,
                          impl: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (topk_idx.new_empty(num_ranks, dtype=torch.int32), topk_idx.new_empty(num_experts, dtype=torch.int32),
            topk_idx.new_empty(topk_idx.shape[0], num_ranks, dtype=torch.bool))


@define("dispatch_layout(Tensor topk_idx, int num_ranks, int num_experts, str? impl) -> (Tensor, Tensor, Tensor)",
        _dispatch_layout_fake)
def _dispatch_layout_op(topk_idx: torch.Tensor, num_ranks: int, num_experts: int,
                        impl: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_layout(topk_idx, num_ranks, num_experts)
    num_tokens, num_topk = topk_idx.shape
    if resolve("dispatch_layout", topk_idx.device, impl) == "triton":
        return _layout_triton(topk_idx, num_ranks, num_experts)
    if topk_idx.device.type != "cpu":
        return dispatch_layout_reference(topk_idx, num_ranks, num_experts).fields()
    if topk_idx.dtype != torch.int64:
        raise ValueError(f"dispatch_layout: topk_idx must be int64, got {topk_idx.dtype}")
    topk_idx = topk_idx.contiguous()
    per_rank = torch.empty(num_ranks, dtype=torch.int32)
    per_expert = torch.empty(num_experts, dtype=torch.int32)
    in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool)
    native().dispatch_layout(per_rank.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(), topk_idx.data_ptr(),
                             num_tokens, num_topk, num_ranks, num_experts, cpu_threads())
    return per_rank, per_expert, in_rank


def _layout_triton(topk_idx: torch.Tensor, num_ranks: int, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    per_rank = torch.zeros(num_ranks, dtype=torch.int32, device=device)
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=device)
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=device)
    if num_tokens and num_topk:
        block = min(_BLOCK_T, next_pow2(num_tokens))
        kernels("layout").dispatch_layout_kernel[(-(-num_tokens // block),)](
            topk_idx.contiguous(), per_rank, per_expert, in_rank.view(torch.uint8), num_tokens, NUM_TOPK=num_topk,
            NUM_RANKS=num_ranks, EXPERTS_PER_RANK=num_experts // num_ranks, BLOCK_T=block)
    return per_rank, per_expert, in_rank


def dispatch_layout_reference(topk_idx: torch.Tensor, num_ranks: int, num_experts: int) -> DispatchLayout:
    """Plain-torch specification of ``dispatch_layout``; also the path for non-CPU devices."""
    check_index("dispatch_layout", "topk_idx", topk_idx, -1, num_experts, f"expert ids of {num_experts} experts")
    num_tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    experts = topk_idx[valid]
    per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
    token_of = torch.arange(num_tokens, device=topk_idx.device).unsqueeze(1).expand_as(topk_idx)
    rank_of = topk_idx // (num_experts // num_ranks)
    in_rank = torch.zeros(num_tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
    in_rank[token_of[valid], rank_of[valid]] = True
    per_rank = in_rank.sum(0, dtype=torch.int32)
    return DispatchLayout(per_rank, per_expert, in_rank)


@dataclass(frozen=True)
class SendPlan:
    """Send order of one dispatch: grouped by destination rank ascending, then token ascending."""

    # send_rows[i] = source token of send row i                                          [S] int64
    send_rows: torch.Tensor
    # send_counts[r] = rows sent to rank r
    send_counts: list[int]
    # send_pos[t, r] = send row carrying token t to rank r, or -1                        [T, R] int32
    send_pos: torch.Tensor


def plan_sends(is_token_in_rank: torch.Tensor) -> SendPlan:
    """The send order for ``is_token_in_rank`` `[T, R]` bool."""
    num_tokens, num_ranks = is_token_in_rank.shape
    pairs = is_token_in_rank.t().nonzero()  # (rank, token), rank-major, tokens ascending
    send_rows = pairs[:, 1].contiguous()
    send_pos = torch.full((num_tokens, num_ranks), -1, dtype=torch.int32, device=is_token_in_rank.device)
    send_pos[pairs[:, 1], pairs[:, 0]] = torch.arange(pairs.shape[0], dtype=torch.int32, device=send_pos.device)
    counts = is_token_in_rank.sum(0).tolist()
    return SendPlan(send_rows, counts, send_pos)


def token_channels(num_tokens: int, num_channels: int, device: torch.device) -> torch.Tensor:
    """``[T]`` int64: each token's channel in DeepEP's split of normal mode (channel c holds tokens
    ``[c * ceil(T / C), (c + 1) * ceil(T / C))``)."""
    per_channel = max(-(-num_tokens // num_channels), 1)
    return torch.arange(num_tokens, device=device) // per_channel
