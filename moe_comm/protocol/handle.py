"""Dispatch handles: DeepEP's normal-mode 6-tuple (10-tuple across nodes) and low-latency 5-tuple,
named inside the library.

A handle comes back from the caller, who may have changed it. ``from_tuple`` checks every index it
carries against what it indexes before any byte moves, and the fields that follow from others
(``send_head`` from ``is_token_in_rank``, ``layout_range``'s begins from its counts) are checked to
be exactly what they follow to. What only the peer can know (which tokens a block of rows
carries) is checked by the handshake's digests, on every rank at once.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..core.checks import check_int, check_tensor
from ..core.errors import bad_argument
from ..ops.layout import SendPlan, plan_sends
from .digest import sent_tokens
from .low_latency_layout import layout_range_check

__all__ = ["InternodeFields", "InternodeHandle", "NormalHandle", "LowLatencyHandle", "SendPlan", "plan_sends"]


@dataclass(frozen=True)
class InternodeFields:
    """The fields DeepEP's internode handle adds (Rn nodes, R ranks, C channels, T tokens sent, N rows
    received, N_rdma tokens this rank forwards; ``backends.portable.internode`` computes them)."""

    # rdma_channel_prefix_matrix[n, c] = tokens this rank sends to node n from channels 0..c     [Rn, C] int32
    rdma_channel_prefix_matrix: torch.Tensor
    # recv_rdma_channel_prefix_matrix[n, c] = the same prefix of the rank with this rank's local
    # index in node n, for this rank's node (the tokens this rank forwards from n)             [Rn, C] int32
    recv_rdma_channel_prefix_matrix: torch.Tensor
    # recv_rdma_rank_prefix_sum[n] = tokens this rank forwards from nodes 0..n                   [Rn] int32
    recv_rdma_rank_prefix_sum: torch.Tensor
    # recv_gbl_channel_prefix_matrix[r, c] = first received row of source r's channel c         [R, C] int32
    recv_gbl_channel_prefix_matrix: torch.Tensor
    # recv_gbl_rank_prefix_sum[r] = rows received from ranks 0..r                                [R] int32
    recv_gbl_rank_prefix_sum: torch.Tensor
    # recv_src_meta[i] = DeepEP's SourceMeta of row i: int32 source node, int32 bit l set when the
    # token also goes to local rank l of this rank's node (node -1 on padding rows)              [N, 8] uint8
    recv_src_meta: torch.Tensor
    # send_rdma_head[t, n] = token t's position among channel c(t)'s tokens to node n, or -1     [T, Rn] int32
    send_rdma_head: torch.Tensor
    # send_nvl_head[i, l] = forwarded token i's position among its channel's tokens to local rank l
    # (forwarded tokens by source node, then token), or -1                                [N_rdma, 8] int32
    send_nvl_head: torch.Tensor


class InternodeHandle(tuple):
    """DeepEP's internode handle, a 10-tuple ``(is_token_in_rank, rdma_channel_prefix_matrix,
    gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
    recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head,
    send_nvl_head)`` (callers index it: ``handle[-4]`` is ``recv_gbl_rank_prefix_sum``), that also
    carries the routing moe-comm combines by (``routing``), since the 10 fields do not say which
    source token each received row is."""

    routing: "NormalHandle"

    def __new__(cls, routing: "NormalHandle") -> "InternodeHandle":
        f = routing.internode
        assert f is not None
        self = super().__new__(cls, (routing.is_token_in_rank, f.rdma_channel_prefix_matrix,
                                     routing.channel_prefix_matrix, f.recv_rdma_channel_prefix_matrix,
                                     f.recv_rdma_rank_prefix_sum, f.recv_gbl_channel_prefix_matrix,
                                     f.recv_gbl_rank_prefix_sum, f.recv_src_meta, f.send_rdma_head, f.send_nvl_head))
        self.routing = routing
        return self

    def __getnewargs__(self) -> tuple:  # pickling and copying rebuild it from the routing
        return (self.routing,)


@dataclass(frozen=True)
class NormalHandle:
    """Routing of one non-cached dispatch, as seen by one rank (R ranks, C channels, T tokens sent,
    N rows received, N = num_worst_tokens when that was set).

    The DeepEP tuple order is kept by ``as_tuple``; callers index it (``handle[0]``, ``handle[3]``,
    ``handle[4]``).
    """

    # rank_prefix_matrix[i, j] = rows ranks 0..i send to rank j (inclusive prefix)         [R, R] int32
    rank_prefix_matrix: torch.Tensor
    # channel_prefix_matrix[r, c] = tokens this rank sends to rank r from channels 0..c,
    # channel c holding tokens [c * ceil(T / C), (c + 1) * ceil(T / C))                    [R, C] int32
    channel_prefix_matrix: torch.Tensor
    # recv_channel_prefix_matrix[r, c] = first row of source r's channel c within r's block [R, C] int32
    recv_channel_prefix_matrix: torch.Tensor
    # recv_src_idx[i] = index in its source rank's x of received row i; -1 on padding rows  [N] int32
    recv_src_idx: torch.Tensor
    # is_token_in_rank[t, r] = token t was sent to rank r                                    [T, R] bool
    is_token_in_rank: torch.Tensor
    # send_head[t, r] = row of token t in this rank's send block order (grouped by
    # destination rank, then token), i.e. where combine finds it among the rows rank r returns; -1
    # if not sent. (DeepEP stores a ring-buffer slot here; only combine reads it.)        [T, R] int32
    send_head: torch.Tensor
    # the internode fields, when the group spans several nodes (``topology.Topology.internode``)
    internode: Optional[InternodeFields] = None

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """DeepEP's handle: the 6-tuple, or the ``InternodeHandle`` 10-tuple across nodes."""
        if self.internode is not None:
            return InternodeHandle(self)
        return (self.rank_prefix_matrix, self.channel_prefix_matrix, self.recv_channel_prefix_matrix,
                self.recv_src_idx, self.is_token_in_rank, self.send_head)

    def with_internode(self, fields: InternodeFields) -> "NormalHandle":
        """This handle with its internode fields."""
        return dataclasses.replace(self, internode=fields)

    @functools.cached_property
    def plan(self) -> SendPlan:
        """This rank's send order of the handle's dispatch (``send_head`` is its ``send_pos``)."""
        return plan_sends(self.is_token_in_rank)

    @functools.cached_property
    def sent(self) -> tuple[list[int], list[int], Optional[tuple[int, int]]]:
        """(tokens this rank sent to each rank in the handle's dispatch, digests of those tokens, the
        first ``[t, r]`` where ``send_head`` is not their send position, or None): ``protocol.digest.sent_tokens``."""
        return sent_tokens(self.is_token_in_rank, self.send_head)

    @functools.cached_property
    def steps(self) -> torch.Tensor:
        """``[R, R]`` int64 on the CPU: steps[i, j] = rows rank j received from rank i (the prefix
        matrix's steps down each column)."""
        prefix = self.rank_prefix_matrix.cpu().to(torch.int64)
        return prefix.diff(dim=0, prepend=prefix.new_zeros(1, prefix.shape[1]))

    def recv_counts(self, rank: int) -> list[int]:
        """Rows ``rank`` received from each source rank."""
        return self.steps[:, rank].tolist()

    def num_recv_rows(self, rank: int) -> int:
        """Real rows ``rank`` received (without num_worst_tokens padding)."""
        return int(self.rank_prefix_matrix[-1, rank].item())

    @staticmethod
    def from_tuple(op: str, handle: Any, rank: int, num_ranks: int, device: torch.device,
                   internode: bool = False) -> "NormalHandle":
        """Checks a DeepEP-style handle for this rank and wraps it: the 6-tuple, or across nodes
        (``internode``) the ``InternodeHandle`` a dispatch of this group returned."""
        if internode:
            if isinstance(handle, InternodeHandle) and handle.routing.is_token_in_rank.shape[1] == num_ranks:
                return handle.routing
            bad_argument(op, "handle", "the 10-tuple handle a dispatch of this buffer returned (the group spans "
                         "several nodes; moe-comm's internode handle carries the routing besides DeepEP's 10 "
                         "fields, so a tuple rebuilt from them cannot be used)",
                         f"{type(handle).__name__} of length {len(handle) if hasattr(handle, '__len__') else '?'}",
                         kind=TypeError)
        if not isinstance(handle, (tuple, list)) or len(handle) != 6:
            bad_argument(op, "handle", "the 6-tuple returned by a non-cached dispatch",
                         f"{type(handle).__name__} of length {len(handle) if hasattr(handle, '__len__') else '?'}",
                         kind=TypeError)
        prefix, chan, recv_chan, src_idx, in_rank, send_head = handle
        check_tensor(op, "handle[0] (rank_prefix_matrix)", prefix, shape=(num_ranks, num_ranks), dtype=torch.int32,
                     device=device)
        check_tensor(op, "handle[1] (channel_prefix_matrix)", chan, shape=(num_ranks, None), dtype=torch.int32)
        check_tensor(op, "handle[2] (recv_channel_prefix_matrix)", recv_chan, shape=(num_ranks, None), dtype=torch.int32)
        check_tensor(op, "handle[3] (recv_src_idx)", src_idx, shape=(None,), dtype=torch.int32, device=device)
        check_tensor(op, "handle[4] (is_token_in_rank)", in_rank, shape=(None, num_ranks), dtype=torch.bool,
                     device=device)
        check_tensor(op, "handle[5] (send_head)", send_head, shape=(in_rank.shape[0], num_ranks), dtype=torch.int32,
                     device=device)
        handle = NormalHandle(prefix, chan, recv_chan, src_idx, in_rank, send_head)
        if bool((handle.steps < 0).any()):
            bad_argument(op, "handle[0] (rank_prefix_matrix)", "an inclusive prefix sum down each column (entries "
                         ">= 0, non-decreasing)", prefix.tolist())
        if handle.num_recv_rows(rank) > src_idx.shape[0]:
            bad_argument(op, "handle[3] (recv_src_idx)", f"at least rank_prefix_matrix[-1, {rank}] = "
                         f"{handle.num_recv_rows(rank)} rows", list(src_idx.shape))
        wrong = handle.sent[2]
        if wrong is not None:
            t, r = wrong
            bad_argument(op, "handle[5] (send_head)", f"the send positions of handle[4] (is_token_in_rank) "
                         f"(first difference at [{t}, {r}]: {int(handle.plan.send_pos[t, r])})", int(send_head[t, r]))
        return handle


@dataclass(frozen=True)
class LowLatencyHandle:
    """Routing of one low-latency dispatch, as seen by the receiving rank (R ranks, E experts,
    E_loc = E / R local experts, M = num_max_dispatch_tokens_per_rank). DeepEP's tuple order is
    kept by ``as_tuple``."""

    # src_info[e, row] = index of the row's token in its source rank's x; -1 past recv_count[e]
    #                                                                               [E_loc, R * M] int32
    src_info: torch.Tensor
    # layout_range[e, s] = begin << 32 | count: rows [begin, begin + count) of expert e came
    # from rank s (blocks by source rank ascending, tokens ascending inside a block) [E_loc, R] int64
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int

    def as_tuple(self) -> tuple:
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden,
                self.num_experts)

    def counts(self) -> torch.Tensor:
        """``[E_loc, R]`` int64 rows per (local expert, source rank)."""
        return self.layout_range & 0xFFFFFFFF

    def begins(self) -> torch.Tensor:
        """``[E_loc, R]`` int64 first row per (local expert, source rank)."""
        return self.layout_range >> 32

    @staticmethod
    def from_tuple(op: str, handle: Any, num_ranks: int, device: torch.device,
                   values: bool = True) -> "LowLatencyHandle":
        """Checks a DeepEP-style low-latency handle tuple for this group and wraps it (``layout_range``'s
        values only with ``values``: they are read on the host)."""
        if not isinstance(handle, (tuple, list)) or len(handle) != 5:
            bad_argument(op, "handle", "the 5-tuple (src_info, layout_range, num_max_dispatch_tokens_per_rank, "
                         "hidden, num_experts) returned by low_latency_dispatch",
                         f"{type(handle).__name__} of length {len(handle) if hasattr(handle, '__len__') else '?'}",
                         kind=TypeError)
        src_info, layout_range, m, hidden, num_experts = handle
        for name, value in (("handle[2] (num_max_dispatch_tokens_per_rank)", m), ("handle[3] (hidden)", hidden),
                            ("handle[4] (num_experts)", num_experts)):
            check_int(op, name, value, minimum=1)
        if num_experts % num_ranks:
            bad_argument(op, "handle[4] (num_experts)", f"a multiple of the group size {num_ranks}", num_experts)
        local = num_experts // num_ranks
        check_tensor(op, "handle[0] (src_info)", src_info, shape=(local, num_ranks * m), dtype=torch.int32,
                     device=device)
        check_tensor(op, "handle[1] (layout_range)", layout_range, shape=(local, num_ranks), dtype=torch.int64,
                     device=device)
        parsed = LowLatencyHandle(src_info, layout_range, m, hidden, num_experts)
        wrong = layout_range_check(layout_range, num_ranks * m) if values else None
        if wrong is not None:
            e, s = wrong
            bad_argument(op, "handle[1] (layout_range)", f"begin << 32 | count blocks by source rank ascending inside "
                         f"[0, {num_ranks * m}), each beginning where the one before ends (begin[e, s] = count[e, 0] + "
                         f"... + count[e, s - 1])", f"begin {int(parsed.begins()[e, s])}, count "
                         f"{int(parsed.counts()[e, s])} at [{e}, {s}] (begins {parsed.begins().tolist()}, counts "
                         f"{parsed.counts().tolist()})")
        return parsed
