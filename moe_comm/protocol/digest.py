"""Routing digests: which tokens a block of rows carries, as one 62-bit number, so two ranks can check in
their handshake that they agree on it (``handshake.py``) without sending the tokens.

``digest(block) = (sum over i of mix(mix(block[i]) + i) mod 2^64) >> 2``, ``mix`` being splitmix64's
finalizer and keys sign-extended to 64 bits: two sides that hold the same block get the same value,
and a changed, moved, added or dropped key changes it (but for collisions of probability about 2^-62).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..core.native import native
from ..ops.layout import plan_sends
from .low_latency_layout import combine_rows_reference

__all__ = ["digests", "digests_reference", "sent_tokens", "sent_tokens_reference", "low_latency_combine_digests",
           "low_latency_combine_digests_reference"]

_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 lanes (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def digests(keys: torch.Tensor, counts: Sequence[int]) -> list[int]:
    """The digests of consecutive blocks of the 1-D integer ``keys`` (any device), block j holding the
    next ``counts[j]`` keys. Local; blocks the host. Reference: ``digests_reference``."""
    if keys.device.type != "cpu" or keys.dtype not in (torch.int32, torch.int64):
        return digests_reference(keys, counts)
    keys = keys.contiguous()
    out = torch.empty(len(counts), dtype=torch.int64)
    native().block_digests(out.data_ptr(), keys.data_ptr(), keys.element_size(), [int(c) for c in counts],
                           keys.numel())
    return out.tolist()


def digests_reference(keys: torch.Tensor, counts: Sequence[int]) -> list[int]:
    """numpy specification of ``digests``; also the path off the CPU."""
    lanes = keys.detach().to("cpu", torch.int64).contiguous().numpy().view(np.uint64)
    counts = np.asarray(counts, dtype=np.int64)
    if int(counts.sum()) != lanes.size or bool((counts < 0).any()):
        raise ValueError(f"digests: {lanes.size} keys for blocks of {counts.tolist()}")
    starts = np.concatenate([[0], np.cumsum(counts)])
    within = np.arange(lanes.size, dtype=np.int64) - np.repeat(starts[:-1], counts)
    with np.errstate(over="ignore"):
        mixed = _mix(_mix(lanes) + within.astype(np.uint64))
        running = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(mixed, dtype=np.uint64)])
        sums = running[starts[1:]] - running[starts[:-1]]  # wraps like the sum itself
    return [int(v) >> 2 for v in sums]


def sent_tokens(is_token_in_rank: torch.Tensor, send_head: torch.Tensor
                ) -> tuple[list[int], list[int], Optional[tuple[int, int]]]:
    """What a normal-mode rank sent, from its handle: (tokens sent to each rank, ``digests`` of those
    tokens in ascending order, the first ``[t, r]`` where ``send_head`` `[T, R]` int32 is not the send
    position of ``is_token_in_rank`` `[T, R]` bool, or None). Local; one native pass on CPU.
    Reference: ``sent_tokens_reference``."""
    if is_token_in_rank.device.type != "cpu":
        return sent_tokens_reference(is_token_in_rank, send_head)
    num_tokens, num_ranks = is_token_in_rank.shape
    counts = torch.empty(num_ranks, dtype=torch.int64)
    sums = torch.empty(num_ranks, dtype=torch.int64)
    in_rank, head = is_token_in_rank.contiguous(), send_head.contiguous()
    first = native().send_order_check(counts.data_ptr(), sums.data_ptr(), in_rank.data_ptr(), head.data_ptr(),
                                      num_tokens, num_ranks)
    return counts.tolist(), sums.tolist(), None if first < 0 else divmod(first, num_ranks)


def sent_tokens_reference(is_token_in_rank: torch.Tensor, send_head: torch.Tensor
                          ) -> tuple[list[int], list[int], Optional[tuple[int, int]]]:
    """Plain-torch specification of ``sent_tokens`` (``plan_sends``' positions); also the path off the CPU."""
    plan = plan_sends(is_token_in_rank)
    wrong = (plan.send_pos != send_head).nonzero()
    return (plan.send_counts, digests_reference(plan.send_rows, plan.send_counts),
            tuple(wrong[0].tolist()) if wrong.shape[0] else None)


def low_latency_combine_digests(layout_range: torch.Tensor, src_info: torch.Tensor, msg: torch.Tensor,
                                experts: torch.Tensor, send_counts: Sequence[int], num_topk: int
                                ) -> tuple[list[int], list[int]]:
    """The routing digests of a low-latency combine, as both sides see it. Local.

    Args:
        layout_range, src_info: the handle's `[E_loc, R]` int64 and `[E_loc, rows]` int32.
        msg, experts: this rank's messages in ``send_order`` (``t * num_topk + k`` and expert ids, int64).
        send_counts: messages this rank sent to each rank.
    Returns:
        (``returned[s]``: digest of the keys ``e << 32 | src_info[e, row]`` of the rows this rank returns
        to rank s, in ``combine_rows`` order; ``asked[d]``: of the keys ``(expert % E_loc) << 32 | token``
        of the messages this rank sent to rank d, in send order): the same two sequences on both sides.
    Reference: ``low_latency_combine_digests_reference``.
    """
    if layout_range.device.type != "cpu":
        return low_latency_combine_digests_reference(layout_range, src_info, msg, experts, send_counts, num_topk)
    local, num_ranks = layout_range.shape
    layout_range, src_info = layout_range.contiguous(), src_info.contiguous()
    msg, experts = msg.contiguous(), experts.contiguous()
    if msg.shape != experts.shape or msg.shape[0] != sum(send_counts) or len(send_counts) != num_ranks:
        raise ValueError(f"low_latency_combine_digests: msg {list(msg.shape)}, experts {list(experts.shape)} and "
                         f"send_counts {list(send_counts)} do not fit")
    returned = torch.empty(num_ranks, dtype=torch.int64)
    asked = torch.empty(num_ranks, dtype=torch.int64)
    native().low_latency_combine_digests(returned.data_ptr(), asked.data_ptr(), layout_range.data_ptr(),
                                         src_info.data_ptr(), msg.data_ptr(), experts.data_ptr(),
                                         [int(c) for c in send_counts], local, src_info.shape[1], num_topk)
    return returned.tolist(), asked.tolist()


def low_latency_combine_digests_reference(layout_range: torch.Tensor, src_info: torch.Tensor, msg: torch.Tensor,
                                          experts: torch.Tensor, send_counts: Sequence[int],
                                          num_topk: int) -> tuple[list[int], list[int]]:
    """Plain-torch specification of ``low_latency_combine_digests``; also the path off the CPU."""
    local, rows = src_info.shape
    send_rows = combine_rows_reference(layout_range, rows)
    returned_keys = (send_rows // rows) << 32 | src_info.reshape(-1)[send_rows].to(torch.int64)
    asked_keys = (experts % local) << 32 | msg // max(num_topk, 1)
    return (digests_reference(returned_keys, (layout_range & 0xFFFFFFFF).sum(0).tolist()),
            digests_reference(asked_keys, send_counts))
