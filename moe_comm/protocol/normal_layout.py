"""DeepEP's normal-mode layouts that every backend produces alike: the channel split of tokens and
its prefix matrices, a token's row within its destination's block, and a dispatch's receive tensors."""
from __future__ import annotations

from typing import Optional

import torch

from ..core.memory import empty
from ..ops.layout import token_channels
from ..transport.base import prefix_sums

__all__ = ["channel_prefix", "dispatch_outputs", "fill_padding", "recv_channel_starts", "rows_within_destination"]


def channel_prefix(is_token_in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[R, C]`` int32: tokens sent to rank r from channels 0..c (DeepEP's channel split of tokens)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    pairs = is_token_in_rank.nonzero()
    flat = pairs[:, 1] * num_channels + token_channels(num_tokens, num_channels, pairs.device)[pairs[:, 0]]
    counts = torch.bincount(flat, minlength=num_ranks * num_channels).view(num_ranks, num_channels)
    return counts.cumsum(1).to(torch.int32)


def recv_channel_starts(chan: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int32: from each source's cumulative ``channel_prefix`` rows to this rank, the
    first row of each channel within that source's block (DeepEP's recv_channel_prefix_matrix)."""
    return (chan - chan.diff(dim=1, prepend=torch.zeros(chan.shape[0], 1, dtype=chan.dtype))).to(torch.int32)


def rows_within_destination(send_head: torch.Tensor, sent: list[int]) -> torch.Tensor:
    """``[T, R]`` int32: token t's row among the rows sent to rank r (-1: not sent), from a handle's
    ``send_head`` (rows counted across destinations) and the rows sent to each rank."""
    starts = torch.tensor(prefix_sums(sent)[:-1], dtype=torch.int32, device=send_head.device)
    return torch.where(send_head >= 0, send_head - starts, -1).to(torch.int32)


def fill_padding(tensors: list[Optional[torch.Tensor]], values: list[float], start: int) -> None:
    """Rows ``start:`` of each tensor (None skipped) set to its value: a dispatch's rows past those received."""
    for t, v in zip(tensors, values):
        if t is not None and t.shape[0] > start:
            t[start:].fill_(v)


def dispatch_outputs(rows: int, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor],
                                torch.Tensor]:
    """A dispatch's receive tensors of ``rows`` rows, uninitialised: recv_x and recv_scales (x's and
    scales' dtypes and widths), recv_topk_idx (topk_idx's dtype) and recv_topk_weights (float32)
    when routing comes with top-k, and recv_src_idx (int32)."""
    device = x.device
    recv_x = empty((rows, x.shape[1]), x.dtype, device)
    recv_scales = None if scales is None else empty((rows, scales.shape[1]), scales.dtype, device)
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        recv_topk_idx = empty((rows, topk_idx.shape[1]), topk_idx.dtype, device)
        recv_topk_weights = empty((rows, topk_idx.shape[1]), torch.float32, device)
    return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, torch.empty(rows, dtype=torch.int32, device=device)
