"""``ElasticBuffer``: DeepEP V2's ``deep_ep.ElasticBuffer`` API (one dispatch and one combine for prefill and
decode), built on ``Buffer``'s normal mode.

A V2 dispatch is one V1 dispatch: the token's bytes (data, scale factors) travel as one record per
(token, rank), routed by ``topk_idx``, and the V2 outputs (expanded layout, prefix sums, source
metadata) are computed from the V1 routing by local tensor arithmetic (``elastic_layout``). A V2 combine
returns each received row to its source with a V1 dispatch the other way (its routing cached in the
handle after the first combine) and sums there in DeepEP V2's order (``elastic_combine``). So every
backend that runs ``Buffer`` runs this, with the same call agreement: bad arguments on one rank fail the
call on every rank, and no byte moves first.

What differs from DeepEP V2, and why, is listed in ``docs/elastic.md``.
"""
from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any, NoReturn, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..backends.base import agreed_call
from ..core.checks import check_flags, check_int, check_tensor, describe
from ..core.errors import bad_argument
from ..core.native import NATIVE_DTYPES
from ..core.topology import Topology, split_nodes
from ..protocol.codes import Field
from ..transport.base import host_id
from . import elastic_layout as lay
from .buffer import Buffer, topk_idx_t
from .elastic_combine import pick_slot_weights, sum_expanded_rows, sum_in_slot_order
from .event import EventHandle, EventOverlap
from .normal_args import check_biases, check_num_experts, check_topk_idx, split_x

__all__ = ["ElasticBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size"]

XType = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
_ALIGN = 16                   # bytes: each part of a record starts aligned (DeepEP's int4 rows)
_BUFFER_ALIGNMENT = 2 << 20   # DeepEP V2 aligns buffer sizes to 2 MiB
_SF_PACK_ALIGN = 4            # DeepEP's kNumAlignedSFPacks: 16-byte TMA alignment of 4-byte packs
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# The V1 methods without their call agreement: an ElasticBuffer call is itself one agreed call.
_v1_dispatch = inspect.unwrap(Buffer._checked_dispatch)  # inside this Buffer's own agreed call


def _align(x: int, y: int) -> int:
    return -(-x // y) * y


class EPHandle:
    """The handle a dispatch returns (DeepEP V2's ``EPHandle``, same attributes): pass it to ``combine``, or
    back to ``dispatch`` to send again with the same routing.

    ``psum_num_recv_tokens_per_scaleup_rank`` `[num_scaleup_ranks]` int32 inclusive prefix of rows received
    per scaleup rank (all scaleout ranks of that index); ``psum_num_recv_tokens_per_expert``
    `[num_local_experts]` int32 (without ``do_expand``: inclusive prefix of the aligned counts; with it:
    expert i's first row plus its count); ``num_unaligned_recv_tokens_per_expert`` `[num_local_experts]`
    int32; ``num_recv_tokens_per_expert_list`` the aligned counts (``[]`` without ``do_cpu_sync``);
    ``recv_src_metadata`` `[N, K + 2]` int32 (``elastic_layout.src_metadata``); ``dst_buffer_slot_idx``
    `[T, K]` int32; ``token_metadata_at_forward`` and ``channel_linked_list`` are None (DeepEP's hybrid
    kernels' bookkeeping; nothing here needs them).
    """

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: list, psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor, num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: Optional[torch.Tensor] = None,
                 channel_linked_list: Optional[torch.Tensor] = None) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        # moe-comm's own: the V1 dispatch handle, its received top-k ids, each row's source rank, and the
        # V1 handles of the combines' return dispatches (one per kind of returned row)
        self._v1: Any = None
        self._recv_topk_idx: Optional[torch.Tensor] = None
        self._src_rank: Optional[torch.Tensor] = None
        self._returns: dict[str, Any] = {}


def _routing(v1_handle: Any) -> Any:
    """The ``NormalHandle`` fields of a V1 handle (the 6-tuple, or the internode one's ``routing``)."""
    routing = getattr(v1_handle, "routing", None)
    if routing is not None:
        return routing
    rank_prefix, _, _, recv_src_idx, is_token_in_rank, send_head = v1_handle
    return _Routing(rank_prefix, recv_src_idx, is_token_in_rank, send_head)


class _Routing:
    def __init__(self, rank_prefix_matrix: torch.Tensor, recv_src_idx: torch.Tensor,
                 is_token_in_rank: torch.Tensor, send_head: torch.Tensor) -> None:
        self.rank_prefix_matrix, self.recv_src_idx = rank_prefix_matrix, recv_src_idx
        self.is_token_in_rank, self.send_head = is_token_in_rank, send_head


def _pack(parts: Sequence[torch.Tensor], num_rows: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Rows of ``parts`` (2-D, any dtypes) side by side as uint8 records, each part 16-byte aligned; returns
    the records and each part's byte offset."""
    views, offsets, width = [], [], 0
    for p in parts:
        v = p.contiguous().view(torch.uint8)  # [rows, cols * element size]
        offsets.append(width)
        pad = (-v.shape[1]) % _ALIGN
        views.append(v)
        if pad:
            views.append(torch.zeros(num_rows, pad, dtype=torch.uint8, device=device))
        width += v.shape[1] + pad
    if len(views) == 1:
        return views[0], offsets
    return torch.cat(views, 1), offsets


def _unpack(records: torch.Tensor, offset: int, dtype: torch.dtype, cols: int, contiguous: bool = False
            ) -> torch.Tensor:
    """Part of ``records`` at byte ``offset``: `[N, cols]` of ``dtype``; a view (callers copy it out), or with
    ``contiguous`` a contiguous tensor (the view itself when the part is the whole record)."""
    nbytes = cols * torch.empty(0, dtype=dtype).element_size()
    part = records[:, offset:offset + nbytes].view(dtype)
    return part.contiguous() if contiguous else part


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)``: the group's nodes and ranks per node, as a ``Buffer`` on it
    sees them (``core.topology``). Collective: every rank of ``group`` calls it."""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_id(), group=group)
    whole = len(hosts) == dist.get_world_size()  # emulated nodes count world ranks (as the transports)
    global_ranks = [dist.get_global_rank(group, r) for r in range(len(hosts))] if whole else None
    topology = Topology.of(split_nodes(hosts, global_ranks))
    return topology.num_nodes, topology.ranks_per_node


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: the nodes and ranks per node in hybrid mode, when the
    group spans several equal nodes; else ``(1, num_ranks)``."""
    nodes, per_node = get_physical_domain_size(group)
    return _logical(nodes, per_node, dist.get_world_size(group), allow_hybrid_mode)


def _logical(nodes: int, per_node: int, num_ranks: int, allow_hybrid_mode: bool) -> tuple[int, int]:
    if allow_hybrid_mode and nodes > 1 and nodes * per_node == num_ranks:
        return nodes, per_node
    return 1, num_ranks


class ElasticBuffer:
    """DeepEP V2's elastic buffer on any ``torch.distributed`` group and device (``deep_ep.ElasticBuffer``).

    Construction is collective. The constructor takes DeepEP V2's arguments; the ones that tune its
    NVLink/RDMA hardware (``sl_idx``, ``num_allocated_qps``, ``prefer_overlap_with_compute``,
    ``num_gpu_timeout_secs``) are checked and kept but change nothing here, and ``deterministic`` is
    always on (outputs are in DeepEP's deterministic order, bitwise the same run after run).
    ``num_cpu_timeout_secs`` is every wait's deadline. ``backend``/``transport`` are ``Buffer``'s.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False,
                 deterministic: bool = False, allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3, num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False,
                 *, backend: str = "auto", transport: str = "auto") -> None:
        op = "ElasticBuffer"
        if not isinstance(group, dist.ProcessGroup):
            bad_argument(op, "group", "a torch.distributed ProcessGroup", describe(group), kind=TypeError)
        for name, value in (("num_cpu_bytes", num_cpu_bytes), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                            ("hidden", hidden), ("num_topk", num_topk), ("sl_idx", sl_idx),
                            ("num_allocated_qps", num_allocated_qps), ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            check_int(op, name, value, minimum=0)
        check_int(op, "num_cpu_timeout_secs", num_cpu_timeout_secs, minimum=1)
        flags = check_flags(op, use_fp8_dispatch=use_fp8_dispatch, deterministic=deterministic,
                            allow_hybrid_mode=allow_hybrid_mode, allow_multiple_reduction=allow_multiple_reduction,
                            prefer_overlap_with_compute=prefer_overlap_with_compute,
                            explicitly_destroy=explicitly_destroy)
        use_fp8_dispatch, deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, \
            explicitly_destroy = flags.values()
        if num_bytes is None:
            num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                           use_fp8_dispatch, allow_hybrid_mode,
                                                           allow_multiple_reduction)
        check_int(op, "num_bytes", num_bytes, minimum=0)
        if num_cpu_bytes > num_bytes:
            bad_argument(op, "num_cpu_bytes", f"at most num_bytes ({num_bytes})", num_cpu_bytes)
        self.group = group
        self.rank_idx, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.explicitly_destroy = explicitly_destroy
        if num_allocated_qps == 0:
            num_allocated_qps = 129 if allow_hybrid_mode else 17   # DeepEP's defaults (no fast RDMA atomics)
        self.num_allocated_qps = num_allocated_qps
        self._buffer = Buffer(group, num_nvl_bytes=num_bytes, num_rdma_bytes=num_bytes, explicitly_destroy=True,
                              backend=backend, transport=transport, timeout_s=float(num_cpu_timeout_secs))
        #: the call agreement ``agreed_call`` runs each collective call in (the V1 buffer's backend)
        self.runtime = self._buffer.runtime
        topology = self._buffer.topology
        self.num_rdma_ranks, self.num_nvlink_ranks = topology.num_nodes, topology.ranks_per_node
        self.num_scaleout_ranks, self.num_scaleup_ranks = _logical(topology.num_nodes, topology.ranks_per_node,
                                                                   self.num_ranks, allow_hybrid_mode)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.timeout_s = float(num_cpu_timeout_secs)

    def __repr__(self) -> str:
        return (f"ElasticBuffer(rank {self.rank_idx} of {self.num_ranks}, {self.num_scaleout_ranks} x "
                f"{self.num_scaleup_ranks}, {self._buffer.backend_choice})")

    # ------------------------------------------------------------------ lifetime and facts
    def destroy(self) -> None:
        """Releases the buffer; later calls are refused. Needs ``explicitly_destroy=True`` (as DeepEP asserts)."""
        if not self.explicitly_destroy:
            raise RuntimeError("ElasticBuffer.destroy: the buffer was built with explicitly_destroy=False, so it is "
                               "released when collected (as DeepEP asserts); build it with explicitly_destroy=True to "
                               "destroy it explicitly")
        self._buffer.destroy()

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes (2 MiB-aligned) that hold one dispatch's and one combine's rows of every rank: what a rank
        may receive, ``num_ranks * num_max_tokens_per_rank`` rows of data, scale factors and top-k."""
        num_ranks = dist.get_world_size(group)
        sf_bytes = 4 * -(-hidden // 128) if use_fp8_dispatch else 0
        data_bytes = hidden * (1 if use_fp8_dispatch else 2)
        row = _align(data_bytes, _ALIGN) + _align(sf_bytes, _ALIGN) + 12 * num_topk + 4
        combine_row = 2 * hidden + 4 * num_topk
        return _align(max(num_ranks * num_max_tokens_per_rank * (row + combine_row), 1), _BUFFER_ALIGNMENT)

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream (CUDA), or an already complete one elsewhere."""
        return EventHandle()

    def get_comm_stream(self) -> Any:
        """The communication stream, or NotImplementedError saying why the backend has none."""
        return self._buffer.get_comm_stream()

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: nodes and ranks per node."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)`` (see ``get_logical_domain_size``)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """DeepEP sizes its kernels' SM count from link bandwidths; here only the handle keeps the number:
        ``Buffer.num_sms`` (even, at least 4)."""
        check_int("get_theoretical_num_sms", "num_experts", num_experts, minimum=1)
        check_int("get_theoretical_num_sms", "num_topk", num_topk, minimum=0)
        return Buffer.num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's QP count for ``num_sms`` (``min(num_sms, 9)``; hybrid mode ``16 * num_sms + 1``), capped
        by ``num_allocated_qps``."""
        check_int("get_theoretical_num_qps", "num_sms", num_sms, minimum=0)
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Waits for every rank of the group (deadline: ``num_cpu_timeout_secs``, naming ranks not heard from
        on gloo groups)."""
        check_flags("barrier", use_comm_stream=use_comm_stream, with_cpu_sync=with_cpu_sync, sequential=sequential)
        self._buffer._alive("barrier")
        if dist.get_backend(self.group) == "gloo":
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s))
        else:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------ dispatch
    @agreed_call("dispatch")
    def dispatch(self, x: XType, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False
                 ) -> tuple[XType, Optional[torch.Tensor], Optional[torch.Tensor], EPHandle, EventOverlap]:
        """Sends each token to every rank holding one of its experts (DeepEP V2 semantics). Collective.

        Args:
            x: `[T, H]` bf16, or ``(x_fp8 [T, H], sf [T, S])`` with 4-byte scale packs (float32 or int32);
                T at most ``num_max_tokens_per_rank``.
            topk_idx, topk_weights: `[T, K]` int64 expert ids (-1: none) and optional float32 weights; with
                ``handle``, topk_idx must be None (the handle's routing is reused) and weights are optional.
            cumulative_local_expert_recv_stats: optional `[num_local_experts]` int32, increased by the rows
                each local expert receives.
            num_experts, num_max_tokens_per_rank, expert_alignment: defaults from ``handle``, the
                constructor and 1.
            do_cpu_sync: True (default without a handle): outputs have exactly the rows received. False:
                outputs have the worst case's rows (``num_ranks * num_max_tokens_per_rank``; expanded:
                DeepEP's bound), valid rows first, and the host reads no tensor data in this layer.
            do_expand: rows per (token, local expert), grouped by expert, each expert's block starting at
                a multiple of ``expert_alignment``; ``recv_topk_idx`` is None and weights are 1-D.
            do_zero_padding: accepted with ``do_expand`` (padding rows are always zero here).
            use_tma_aligned_col_major_sf: received scale factors column-major, the token stride 1 and the
                column stride the row count aligned to 4.
            num_sms, num_qps, allocate_on_comm_stream: checked, no effect (no SMs, QPs or comm stream).
            previous_event, previous_event_before_epilogue: waited before the call.
            async_with_compute_stream: the returned event is valid (already complete on CPU).
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; rows in DeepEP's deterministic
            order (source rank, then source token); ``recv_topk_idx`` holds local expert ids or -1;
            ``recv_topk_weights`` is 0 where ``recv_topk_idx`` is -1.
        """
        op = "dispatch"
        self._buffer._alive(op)
        data, sf = self._split_x(op, x)
        async_with_compute_stream, allocate_on_comm_stream, do_handle_copy, do_expand, do_zero_padding, \
            use_tma_aligned_col_major_sf = check_flags(
                op, async_with_compute_stream=async_with_compute_stream,
                allocate_on_comm_stream=allocate_on_comm_stream, do_handle_copy=do_handle_copy, do_expand=do_expand,
                do_zero_padding=do_zero_padding, use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf).values()
        self._check_resources(op, num_sms, num_qps)
        if do_zero_padding and not do_expand:
            bad_argument(op, "do_zero_padding", "False unless do_expand=True (as DeepEP asserts)", do_zero_padding)
        self._check_events(op, previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        if handle is not None:
            return self._cached_dispatch(op, data, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                                         num_experts, num_max_tokens_per_rank, expert_alignment, handle, do_cpu_sync,
                                         do_expand, use_tma_aligned_col_major_sf, async_with_compute_stream)
        do_cpu_sync = check_flags(op, do_cpu_sync=True if do_cpu_sync is None else do_cpu_sync)["do_cpu_sync"]
        max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        check_int(op, "num_max_tokens_per_rank", max_tokens, minimum=1)
        if data.shape[0] > max_tokens:
            bad_argument(op, "x", f"at most num_max_tokens_per_rank={max_tokens} rows", describe(data))
        alignment = 1 if expert_alignment is None else expert_alignment
        check_int(op, "expert_alignment", alignment, minimum=1)
        if topk_idx is None:
            bad_argument(op, "topk_idx", "a [num_tokens, num_topk] int64 tensor without handle", "None")
        num_experts = check_num_experts(op, num_experts, self.num_ranks, data.device)
        topk_idx = check_topk_idx(op, topk_idx, num_experts, data.shape[0], data.device)
        num_topk = topk_idx.shape[1]
        if topk_weights is not None:
            check_tensor(op, "topk_weights", topk_weights, shape=(data.shape[0], num_topk), dtype=torch.float32,
                         device=data.device)
        num_local = num_experts // self.num_ranks
        self._check_stats(op, cumulative_local_expert_recv_stats, num_local, data.device)
        self._check_duplicates(op, topk_idx)

        agreement = getattr(self.runtime, "agreement", None)
        if agreement is not None:  # recv_src_metadata numbers tokens by it: every rank must pass the same
            agreement.agree_also({Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: max_tokens})
        payload, offsets = _pack([data] + ([] if sf is None else [sf]), data.shape[0], data.device)
        weights = topk_weights if topk_weights is not None else \
            torch.zeros(topk_idx.shape, dtype=torch.float32, device=data.device)
        worst = 0 if do_cpu_sync else self.num_ranks * max_tokens
        recv, recv_topk_idx, recv_weights, expert_list, v1_handle, _ = _v1_dispatch(
            self._buffer, payload, topk_idx=topk_idx, topk_weights=weights, expert_alignment=alignment,
            num_worst_tokens=worst, num_experts=num_experts)
        routing = _routing(v1_handle)
        num_rows = recv.shape[0]
        src_rank = lay.source_ranks(routing.rank_prefix_matrix[:, self.rank_idx], num_rows)
        counts = lay.expert_counts(recv_topk_idx, num_local)
        aligned_counts = lay.aligned(counts, alignment)
        slots = lay.expanded_slots(recv_topk_idx, counts, alignment) if do_expand else None
        if do_cpu_sync:
            num_expanded = sum(expert_list)
        else:
            num_expanded = _align(self.num_ranks * max_tokens * min(num_topk, num_local) + (alignment - 1) * num_local,
                                  alignment)
        if do_expand:
            psum_expert = aligned_counts.cumsum(0) - aligned_counts + counts
        else:
            psum_expert = aligned_counts.cumsum(0)
        per_rank = torch.diff(routing.rank_prefix_matrix[:, self.rank_idx].to(torch.int64),
                              prepend=torch.zeros(1, dtype=torch.int64, device=data.device))
        per_scaleup = per_rank.view(self.num_scaleout_ranks, self.num_scaleup_ranks).sum(0)
        ranks = lay.slot_ranks(topk_idx, num_local)
        handle = EPHandle(do_expand, num_experts, alignment, max_tokens, num_sms or Buffer.num_sms,
                          topk_idx.clone() if do_handle_copy else topk_idx,
                          num_rows, num_expanded, list(expert_list) if do_cpu_sync else [],
                          per_scaleup.cumsum(0).to(torch.int32), psum_expert.to(torch.int32), counts,
                          lay.src_metadata(src_rank, routing.recv_src_idx, recv_topk_idx, slots, max_tokens),
                          lay.dst_buffer_slots(ranks, routing.send_head, routing.rank_prefix_matrix,
                                               routing.is_token_in_rank, self.rank_idx))
        handle._v1, handle._recv_topk_idx, handle._src_rank = v1_handle, recv_topk_idx, src_rank
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts)
        recv_x, recv_sf = self._outputs(recv, offsets, data, sf, num_rows, use_tma_aligned_col_major_sf)
        out_weights = recv_weights if topk_weights is not None else None
        if do_expand:
            recv_x, recv_sf, out_weights = self._expand(recv_x, recv_sf, out_weights, slots, num_expanded,
                                                        use_tma_aligned_col_major_sf)
            recv_topk_idx = None
        recv_x_out = recv_x if recv_sf is None else (recv_x, recv_sf)
        return recv_x_out, recv_topk_idx, out_weights, handle, self._event(async_with_compute_stream)

    def _cached_dispatch(self, op: str, data: torch.Tensor, sf: Optional[torch.Tensor], topk_idx: Any,
                         topk_weights: Any, stats: Any, num_experts: Any, num_max_tokens_per_rank: Any,
                         expert_alignment: Any, handle: Any, do_cpu_sync: Any, do_expand: bool, tma_sf: bool,
                         async_with_compute_stream: bool
                         ) -> tuple[XType, Optional[torch.Tensor], Optional[torch.Tensor], EPHandle, EventOverlap]:
        if not isinstance(handle, EPHandle) or handle._v1 is None:
            bad_argument(op, "handle", "an EPHandle from this library's ElasticBuffer.dispatch", describe(handle),
                         kind=TypeError)
        if topk_idx is not None:
            bad_argument(op, "topk_idx", "None when handle is given (the handle's routing is reused)",
                         describe(topk_idx))
        if do_cpu_sync:
            bad_argument(op, "do_cpu_sync", "None or False when handle is given (as DeepEP asserts)", do_cpu_sync)
        for name, value, held in (("num_experts", num_experts, handle.num_experts),
                                  ("expert_alignment", expert_alignment, handle.expert_alignment),
                                  ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank)):
            if value is not None and value != held:
                bad_argument(op, name, f"None or the handle's {held}", describe(value))
        if do_expand and not handle.do_expand:
            bad_argument(op, "do_expand", "False with a handle from a dispatch without do_expand (its expanded rows "
                         "were not laid out)", do_expand)
        num_tokens, num_topk = handle.topk_idx.shape
        if data.shape[0] != num_tokens:
            bad_argument(op, "x", f"{num_tokens} rows (the tokens of the handle's dispatch)", describe(data))
        if topk_weights is not None:
            check_tensor(op, "topk_weights", topk_weights, shape=(num_tokens, num_topk), dtype=torch.float32,
                         device=data.device)
        num_local = handle.num_experts // self.num_ranks
        self._check_stats(op, stats, num_local, data.device)
        parts = [data] + ([] if sf is None else [sf]) + ([] if topk_weights is None else [topk_weights])
        payload, offsets = _pack(parts, num_tokens, data.device)
        recv = _v1_dispatch(self._buffer, payload, handle=handle._v1)[0]
        num_rows = recv.shape[0]
        recv_topk_idx = handle._recv_topk_idx
        if stats is not None:
            stats.add_(lay.expert_counts(recv_topk_idx, num_local))
        recv_x, recv_sf = self._outputs(recv, offsets, data, sf, num_rows, tma_sf)
        out_weights = None
        if topk_weights is not None:
            got = _unpack(recv, offsets[-1], torch.float32, num_topk)
            out_weights = torch.where(recv_topk_idx >= 0, got, 0.0)
        if do_expand:
            slots = handle.recv_src_metadata[:, 2:]
            recv_x, recv_sf, out_weights = self._expand(recv_x, recv_sf, out_weights, slots,
                                                        handle.num_expanded_tokens, tma_sf)
            return (recv_x if recv_sf is None else (recv_x, recv_sf)), None, out_weights, handle, \
                self._event(async_with_compute_stream)
        recv_x_out = recv_x if recv_sf is None else (recv_x, recv_sf)
        return recv_x_out, recv_topk_idx.clone(), out_weights, handle, self._event(async_with_compute_stream)

    def _outputs(self, recv: torch.Tensor, offsets: list[int], data: torch.Tensor, sf: Optional[torch.Tensor],
                 num_rows: int, tma_sf: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The received data and scale factors out of the received records."""
        hidden = data.shape[1]
        recv_x = _unpack(recv, offsets[0], data.dtype, hidden, contiguous=True)
        if sf is None:
            return recv_x, None
        got = _unpack(recv, offsets[1], sf.dtype, sf.shape[1])
        return recv_x, self._sf_out(got, num_rows, tma_sf)

    @staticmethod
    def _sf_out(values: torch.Tensor, num_rows: int, tma_sf: bool) -> torch.Tensor:
        num_packs = values.shape[1]
        if tma_sf:
            out = torch.empty_strided((num_rows, num_packs), (1, _align(num_rows, _SF_PACK_ALIGN)),
                                      dtype=values.dtype, device=values.device)
        else:
            out = torch.empty(num_rows, num_packs, dtype=values.dtype, device=values.device)
        out.copy_(values)
        return out

    def _expand(self, recv_x: torch.Tensor, recv_sf: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                slots: torch.Tensor, num_expanded: int, tma_sf: bool
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Rows per (row, slot) placed at ``slots`` in zeroed `[num_expanded, ...]` outputs (a spare last row
        takes the slots without an expert, so no host read picks the valid ones)."""
        num_rows, num_topk = slots.shape
        flat = slots.reshape(-1).to(torch.int64)
        target = torch.where(flat >= 0, flat, num_expanded)
        source = torch.arange(num_rows, device=recv_x.device).repeat_interleave(num_topk)

        def place(values: torch.Tensor) -> torch.Tensor:
            bits = values.view(_BITS[values.element_size()])  # moved as bits: float8 has no index_copy
            out = torch.zeros((num_expanded + 1,) + tuple(values.shape[1:]), dtype=bits.dtype, device=values.device)
            out.index_copy_(0, target, bits[source])
            return out[:num_expanded].view(values.dtype)

        x_out = place(recv_x)
        sf_out = None if recv_sf is None else self._sf_out(place(recv_sf.contiguous()), num_expanded, tma_sf)
        w_out = None
        if weights is not None:
            w_out = torch.zeros(num_expanded + 1, dtype=torch.float32, device=recv_x.device)
            w_out.index_copy_(0, target, weights.reshape(-1))
            w_out = w_out[:num_expanded]
        return x_out, sf_out, w_out

    # ------------------------------------------------------------------ combine
    @agreed_call("combine")
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Returns each received row to its token's rank and sums there (DeepEP V2 semantics). Collective.

        Args:
            x: `[N, H]` bf16 (fp16 and fp32 too): one row per received row of ``handle``'s dispatch (with
                ``do_expand``: one per expanded row), padding rows ignored.
            handle: from the non-cached dispatch.
            topk_weights: optional float32, `[N, K]` (`[N_expanded]` with ``do_expand``, which needs
                ``allow_multiple_reduction``); each slot's weight comes back from the rank holding its
                expert.
            bias: None, a tensor or a 2-tuple of `[T, H]` of x's dtype: the first terms of the sum.
        Returns:
            ``(combined_x [T, H], combined_topk_weights [T, K] or None, event)``. ``combined_x[t]`` is, in
            fp32 and rounded once: ``bias0 + bias1``, then each contributing rank's row in the order of
            its last top-k slot; with ``do_expand`` a rank's row is the sum of its slots' rows (rounded);
            without ``allow_multiple_reduction`` every slot's row comes back on its own. In hybrid mode
            with multiple reductions, each node's rank rows are summed first (rounded), in the same order.
        """
        op = "combine"
        self._buffer._alive(op)
        async_with_compute_stream, allocate_on_comm_stream = check_flags(
            op, async_with_compute_stream=async_with_compute_stream,
            allocate_on_comm_stream=allocate_on_comm_stream).values()
        self._check_resources(op, num_sms, num_qps)
        self._check_events(op, previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        if not isinstance(handle, EPHandle) or handle._v1 is None:
            bad_argument(op, "handle", "an EPHandle from this library's ElasticBuffer.dispatch", describe(handle),
                         kind=TypeError)
        num_rows = handle.recv_src_metadata.shape[0]
        rows = handle.num_expanded_tokens if handle.do_expand else num_rows
        check_tensor(op, "x", x, shape=(rows, None), dtype=NATIVE_DTYPES)
        num_tokens, num_topk = handle.topk_idx.shape
        if topk_weights is not None:
            if handle.do_expand and not self.allow_multiple_reduction:
                bad_argument(op, "topk_weights", "None for an expanded handle when allow_multiple_reduction=False "
                             "(as DeepEP)", describe(topk_weights))
            shape = (rows,) if handle.do_expand else (rows, num_topk)
            check_tensor(op, "topk_weights", topk_weights, shape=shape, dtype=torch.float32, device=x.device)
        biases = check_biases(op, bias, num_tokens, x)
        x = x.contiguous()
        num_local = handle.num_experts // self.num_ranks
        ranks = lay.slot_ranks(handle.topk_idx, num_local)
        routing = _routing(handle._v1)
        send_head = routing.send_head.to(torch.int64)
        rank_slot_rows = torch.where(ranks >= 0, torch.gather(send_head, 1, ranks.clamp(min=0)), -1)
        nodes = None
        if self.allow_multiple_reduction and self.num_scaleout_ranks > 1:
            nodes = torch.where(ranks >= 0, torch.div(ranks, self.num_scaleup_ranks, rounding_mode="floor"), -1)
        if handle.do_expand and not self.allow_multiple_reduction:
            returned = self._return_slot_rows(x, handle)
            out = sum_in_slot_order(returned, lay.slot_positions(ranks, self.num_ranks), None, None,
                                    self.num_scaleout_ranks, *biases)
            return out, None, self._event(async_with_compute_stream)
        if handle.do_expand:
            local_rows, local_weights = sum_expanded_rows(x, topk_weights, handle.recv_src_metadata[:, 2:])
        else:
            local_rows, local_weights = x, topk_weights
        returned, returned_weights = self._return_rows(local_rows, local_weights, handle)
        out = sum_in_slot_order(returned, rank_slot_rows, ranks, nodes, self.num_scaleout_ranks, *biases)
        out_weights = None if returned_weights is None else pick_slot_weights(returned_weights, rank_slot_rows)
        return out, out_weights, self._event(async_with_compute_stream)

    def _return_rows(self, rows: torch.Tensor, weights: Optional[torch.Tensor], handle: EPHandle
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sends received row i (and its weights) back to its source rank; returns the rows this rank gets
        back, grouped by the rank returning them, then token (``send_head``'s order)."""
        parts = [rows] + ([] if weights is None else [weights])
        kind = "rank" if weights is None else "rank+weights"
        payload, offsets = _pack(parts, rows.shape[0], rows.device)
        back = self._send_back(kind, payload, handle._src_rank, handle)
        got = _unpack(back, offsets[0], rows.dtype, rows.shape[1], contiguous=True)
        got_weights = None if weights is None else _unpack(back, offsets[1], torch.float32, weights.shape[1])
        return got, got_weights

    def _return_slot_rows(self, x: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """Sends each expanded row back to its source on its own, in (row, slot) order."""
        slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
        num_topk = slots.shape[1]
        rows = x[slots.clamp(min=0).reshape(-1)]
        src = handle._src_rank.repeat_interleave(num_topk)
        dest = torch.where(slots.reshape(-1) >= 0, src, self.num_ranks)
        payload, offsets = _pack([rows], rows.shape[0], x.device)
        back = self._send_back("slot", payload, dest, handle)
        return _unpack(back, offsets[0], x.dtype, x.shape[1], contiguous=True)

    def _send_back(self, kind: str, payload: torch.Tensor, dest: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """A V1 dispatch of ``payload`` row i to rank ``dest[i]`` (none where it is ``num_ranks``); its routing is
        cached in ``handle`` per ``kind``. Returns the rows received, `num_tokens * num_ranks` (padded)."""
        cached = handle._returns.get(kind)
        if cached is not None:
            return _v1_dispatch(self._buffer, payload, handle=cached)[0]
        topk = torch.where(dest < self.num_ranks, dest, -1).to(topk_idx_t).unsqueeze(1).contiguous()
        weights = torch.zeros(topk.shape, dtype=torch.float32, device=payload.device)
        worst = max(handle.topk_idx.shape[0] * handle.topk_idx.shape[1] if kind == "slot"
                    else handle.topk_idx.shape[0] * self.num_ranks, 1)
        recv, _, _, _, v1_handle, _ = _v1_dispatch(self._buffer, payload, topk_idx=topk, topk_weights=weights,
                                                   num_worst_tokens=worst, num_experts=self.num_ranks)
        handle._returns[kind] = v1_handle
        return recv

    # ------------------------------------------------------------------ checks and events
    @staticmethod
    def _split_x(op: str, x: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """V1's ``split_x``, and a BF16 (fp16, fp32) tensor when there are no scale factors."""
        data, sf = split_x(op, x)
        if sf is None:
            check_tensor(op, "x", data, shape=(None, None), dtype=NATIVE_DTYPES)
        return data.contiguous(), sf

    def _check_resources(self, op: str, num_sms: Any, num_qps: Any) -> None:
        check_int(op, "num_sms", num_sms, minimum=0)
        check_int(op, "num_qps", num_qps, minimum=0)
        if num_qps > self.num_allocated_qps:
            bad_argument(op, "num_qps", f"at most num_allocated_qps={self.num_allocated_qps} (as DeepEP asserts)",
                         num_qps)

    @staticmethod
    def _check_events(op: str, previous_event: Any, before_epilogue: Any, allocate_on_comm_stream: bool) -> None:
        for name, event in (("previous_event", previous_event), ("previous_event_before_epilogue", before_epilogue)):
            if event is not None and not isinstance(event, EventHandle):
                bad_argument(op, name, "an EventHandle (from capture()) or None", describe(event), kind=TypeError)
        if previous_event is not None and not allocate_on_comm_stream:
            bad_argument(op, "allocate_on_comm_stream", "True when previous_event is given (as DeepEP documents)",
                         allocate_on_comm_stream)
        for event in (previous_event, before_epilogue):
            if event is not None:
                event.current_stream_wait()

    @staticmethod
    def _check_stats(op: str, stats: Any, num_local: int, device: torch.device) -> None:
        if stats is not None:
            check_tensor(op, "cumulative_local_expert_recv_stats", stats, shape=(num_local,), dtype=torch.int32,
                         device=device)

    @staticmethod
    def _check_duplicates(op: str, topk_idx: torch.Tensor) -> None:
        """An expert twice in one token's top-k is refused (DeepEP's kernels assert it away)."""
        if topk_idx.shape[1] < 2 or not topk_idx.numel():
            return
        ordered = topk_idx.sort(1).values
        twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(twice.any()):
            token = int(twice.any(1).nonzero()[0, 0])
            bad_argument(op, "topk_idx", "distinct experts in each token's row (or -1)",
                         f"row {token} = {topk_idx[token].tolist()}")

    @staticmethod
    def _event(async_with_compute_stream: bool) -> EventOverlap:
        return EventOverlap(EventHandle()) if async_with_compute_stream else EventOverlap()

    # ------------------------------------------------------------------ what is not built
    def _refuse(self, method: str) -> NoReturn:
        raise NotImplementedError(
            f"ElasticBuffer.{method}: not implemented in moe-comm (DeepEP V2's experimental Engram, pipeline-parallel "
            f"send/recv and all-gather/reduce-scatter sessions); docs/elastic.md says what is built and why")

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        """DeepEP V2's Engram storage write: NotImplementedError (docs/elastic.md)."""
        self._refuse("engram_write")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False) -> Any:
        """DeepEP V2's Engram fetch: NotImplementedError (docs/elastic.md)."""
        self._refuse("engram_fetch")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """DeepEP V2's pipeline send/recv configuration: NotImplementedError (docs/elastic.md)."""
        self._refuse("pp_set_config")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """DeepEP V2's pipeline send: NotImplementedError (docs/elastic.md)."""
        self._refuse("pp_send")

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """DeepEP V2's pipeline receive: NotImplementedError (docs/elastic.md)."""
        self._refuse("pp_recv")

    def create_agrs_session(self) -> None:
        """DeepEP V2's all-gather/reduce-scatter session: NotImplementedError (docs/elastic.md)."""
        self._refuse("create_agrs_session")

    def destroy_agrs_session(self) -> None:
        """DeepEP V2's all-gather/reduce-scatter session: NotImplementedError (docs/elastic.md)."""
        self._refuse("destroy_agrs_session")

    def agrs_new_session(self, enabled: bool = True) -> Any:
        """DeepEP V2's all-gather/reduce-scatter session: NotImplementedError (docs/elastic.md)."""
        self._refuse("agrs_new_session")

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """DeepEP V2's all-gather/reduce-scatter configuration: NotImplementedError (docs/elastic.md)."""
        self._refuse("agrs_set_config")

    def agrs_get_inplace_tensor(self, shapes: Any, dtype: torch.dtype) -> Any:
        """DeepEP V2's all-gather/reduce-scatter tensors: NotImplementedError (docs/elastic.md)."""
        self._refuse("agrs_get_inplace_tensor")

    def all_gather(self, t: Any) -> Any:
        """DeepEP V2's session all-gather: NotImplementedError (docs/elastic.md)."""
        self._refuse("all_gather")
