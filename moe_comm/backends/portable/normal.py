"""Normal (high-throughput) mode: dispatch and combine over any transport, on any device.

    dispatch:  handshake (args, row counts)  ->  expert counts  ->  pack records  ->  all-to-all  ->  unpack
    combine:   handshake (args, row counts)  ->  pack records   ->  all-to-all    ->  fixed-order reduce

The handshakes block the host (the receive sizes must be known, as in DeepEP); the payload exchange
is asynchronous, and ``finish()`` completes it and fills the returned tensors. Row order is DeepEP's:
received rows are grouped by source rank ascending and, within a block, by source token ascending.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ...core.config import Config
from ...core.errors import CrossRankMismatchError, bad_argument
from ...core.memory import empty
from ...core.topology import Topology
from ...ops.combine_reduce import combine_reduce
from ...ops.layout import DispatchLayout, SendPlan, plan_sends
from ...ops.node_reduce import combine_reduce_by_node
from ...ops.records import RecordLayout, pack_rows, unpack_rows
from ...ops.rows import take_rows
from ...protocol.agreement import CallAgreement
from ...protocol.codes import Field, Op, WireDType
from ...protocol.digest import digests
from ...protocol.handle import NormalHandle
from ...protocol.handshake import Handshake
from ...protocol.normal_layout import (channel_prefix, dispatch_outputs, fill_padding, recv_channel_starts,
                                       rows_within_destination)
from ...transport import Transport
from ..base import DispatchResult
from .internode import attach_internode

__all__ = ["NormalMode"]


_X_FIELDS = (Field.HIDDEN, Field.X_DTYPE, Field.NUM_SCALES, Field.SCALES_DTYPE)
_RING_FIELDS = (Field.NUM_MAX_NVL_CHUNKED_SEND_TOKENS, Field.NUM_MAX_NVL_CHUNKED_RECV_TOKENS)
_RDMA_FIELDS = (Field.NUM_MAX_RDMA_CHUNKED_SEND_TOKENS, Field.NUM_MAX_RDMA_CHUNKED_RECV_TOKENS)


def _ring_fields(config: Config) -> dict[Field, int]:
    """The handshake fields of a config's ring geometry (``_RING_FIELDS``, and ``_RDMA_FIELDS`` that
    only groups of several nodes compare, as only DeepEP's internode kernels use them)."""
    return {Field.NUM_MAX_NVL_CHUNKED_SEND_TOKENS: config.num_max_nvl_chunked_send_tokens,
            Field.NUM_MAX_NVL_CHUNKED_RECV_TOKENS: config.num_max_nvl_chunked_recv_tokens,
            Field.NUM_MAX_RDMA_CHUNKED_SEND_TOKENS: config.num_max_rdma_chunked_send_tokens,
            Field.NUM_MAX_RDMA_CHUNKED_RECV_TOKENS: config.num_max_rdma_chunked_recv_tokens}


def _x_fields(x: torch.Tensor, scales: Optional[torch.Tensor]) -> dict[Field, int]:
    """The handshake fields that describe a dispatch's payload (``_X_FIELDS``)."""
    return {Field.HIDDEN: x.shape[1], Field.X_DTYPE: WireDType.code(x.dtype),
            Field.NUM_SCALES: -1 if scales is None else scales.shape[1],
            Field.SCALES_DTYPE: WireDType.code(None if scales is None else scales.dtype)}


def _own_rows(fields: list[torch.Tensor], src_rows: torch.Tensor, outputs: list[torch.Tensor], start: int) -> None:
    """This rank's rows to itself, in one copy: ``outputs[f][start + i] = fields[f][src_rows[i]]``."""
    for field, out in zip(fields, outputs):
        take_rows(out[start:start + src_rows.shape[0]], field, src_rows)


def _unpack_around(records_layout: RecordLayout, received: torch.Tensor, outputs: list[torch.Tensor],
                   before: int, own: int) -> None:
    """Unpacks records that skip this rank's own block: the first ``before`` rows to output rows
    ``[0, before)``, the rest after the ``own`` rows this rank copied itself."""
    rest = received.shape[0] - before
    unpack_rows(records_layout, received[:before], [o[:before] for o in outputs])
    unpack_rows(records_layout, received[before:], [o[before + own:before + own + rest] for o in outputs])


class NormalMode:
    """Normal-mode operations of one ``Buffer`` over its transport, in calls of its agreement."""

    def __init__(self, transport: Transport, agreement: CallAgreement, topology: Topology) -> None:
        self.transport, self.agreement, self.topology = transport, agreement, topology
        self._rings = _RING_FIELDS + (_RDMA_FIELDS if topology.internode else ())  # the ring fields compared
        self.rank, self.num_ranks = transport.rank, transport.num_ranks

    def _exchange(self, op: str, records_layout: RecordLayout, fields: list[torch.Tensor], src_rows: torch.Tensor,
                  sent: list[list[int]], device: torch.device,
                  skip_self: bool = True) -> Callable[[Callable[[torch.Tensor], None]], None]:
        """Starts the payload exchange of ``sent`` (rows between every pair of ranks): this rank's
        records are rows ``src_rows`` of ``fields`` (destination-major); with ``skip_self`` the rows
        for this rank stay out (the caller copies them once, directly). Returns ``complete(consume)``:
        waits, calls ``consume(received records)``, then releases them."""
        def rows(dest: int, first: int, out: torch.Tensor) -> None:
            pack_rows(records_layout, fields, src_rows[first:first + out.shape[0]], out=out)

        exchange = self.transport.exchange(sent, records_layout.record_bytes, rows, op=op, device=device,
                                           skip_self=skip_self)

        def complete(consume: Callable[[torch.Tensor], None]) -> None:
            try:
                consume(exchange.wait())
            finally:
                exchange.release()

        return complete

    def _received_blocks(self, handle: NormalHandle) -> tuple[list[int], list[int], int]:
        """(rows this rank received from each rank in the handle's dispatch, digests of the source
        tokens they carry, digest of the rank prefix matrix)."""
        counts = handle.recv_counts(self.rank)
        return (counts, digests(handle.recv_src_idx[:sum(counts)], counts),
                digests(handle.rank_prefix_matrix.reshape(-1), [handle.rank_prefix_matrix.numel()])[0])

    def _deliver(self, complete: Callable[[Callable[[torch.Tensor], None]], None], records_layout: RecordLayout,
                 fields: list[torch.Tensor], plan: SendPlan, recv_counts: list[int],
                 outputs: list[torch.Tensor]) -> Callable[[], None]:
        """The step that fills ``outputs`` (rows by source rank): this rank's own rows copied from
        ``fields`` directly, then the received rows unpacked around them."""
        me = self.rank
        own_rows = plan.send_rows[sum(plan.send_counts[:me]):sum(plan.send_counts[:me + 1])]
        before, own = sum(recv_counts[:me]), recv_counts[me]

        def deliver() -> None:
            _own_rows(fields, own_rows, outputs, before)
            complete(lambda received: _unpack_around(records_layout, received, outputs, before, own))

        return deliver

    # ------------------------------------------------------------------ dispatch
    def agree_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                       layout: DispatchLayout, num_worst_tokens: int, config: Config) -> tuple[SendPlan, Handshake]:
        """A non-cached dispatch's send plan and handshake (collective; blocks the host)."""
        num_experts = layout.num_tokens_per_expert.numel()
        plan = plan_sends(layout.is_token_in_rank)
        fields = {**_x_fields(x, scales), Field.NUM_TOPK: -1 if topk_idx is None else topk_idx.shape[1],
                  Field.NUM_EXPERTS: num_experts, Field.NUM_CHANNELS: config.num_channels,
                  Field.NUM_WORST_TOKENS: num_worst_tokens, **_ring_fields(config)}
        shake = self.agreement.handshake("dispatch", Op.DISPATCH, fields, plan.send_counts, None,
                                         _X_FIELDS + (Field.NUM_TOPK, Field.NUM_EXPERTS, Field.NUM_CHANNELS)
                                         + self._rings, self.transport.device, verdict=_check_worst)
        return plan, shake

    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], layout: DispatchLayout, expert_alignment: int,
                 num_worst_tokens: int, config: Config) -> DispatchResult:
        """Non-cached dispatch of checked arguments (see ``Buffer.dispatch``)."""
        R, me, device = self.num_ranks, self.rank, x.device
        num_channels = config.num_channels
        num_experts = layout.num_tokens_per_expert.numel()
        experts_per_rank = num_experts // R
        room = self.transport.metadata_room  # the per-expert counts and channel prefixes below travel there
        if room is not None and 8 * (experts_per_rank + num_channels) > room:
            bad_argument("dispatch", "num_experts", f"at most {(room // 8 - num_channels) * R} on {R} ranks: each "
                         f"rank's counts per local expert, with its {num_channels} channel prefixes, go to every "
                         f"rank in the {self.transport.name} transport's {room}-byte metadata cells (DeepEP allows "
                         f"at most 1024 local experts)", num_experts)
        plan, shake = self.agree_dispatch(x, scales, topk_idx, layout, num_worst_tokens, config)
        recv_counts = shake.recv_counts(me)
        num_recv = sum(recv_counts)
        rank_prefix = shake.sent.cumsum(0).to(torch.int32).to(device)

        # Expert counts and channel prefixes per destination (the width is now known to agree),
        # posted before the payload so both exchanges are in flight together: one round trip.
        chan_prefix = channel_prefix(layout.is_token_in_rank, num_channels)
        meta = torch.cat([layout.num_tokens_per_expert.view(R, experts_per_rank).to(torch.int64),
                          chan_prefix.to(torch.int64)], dim=1).contiguous()
        got = torch.empty_like(meta)
        counts_pending = self.transport.all_to_all(got, meta, [1] * R, [1] * R, op="dispatch")

        # Payload: one record per (token, destination rank).
        src_index = torch.arange(x.shape[0], dtype=torch.int32, device=device).unsqueeze(1)
        specs = [("x", x.dtype, x.shape[1])]
        fields_in: list[torch.Tensor] = [x]
        if scales is not None:
            specs.append(("scales", scales.dtype, scales.shape[1]))
            fields_in.append(scales)
        if topk_idx is not None:
            specs += [("topk_idx", topk_idx.dtype, topk_idx.shape[1]), ("topk_weights", torch.float32, topk_idx.shape[1])]
            fields_in += [topk_idx, topk_weights]
        specs.append(("src_idx", torch.int32, 1))
        fields_in.append(src_index)
        records_layout = RecordLayout.build(specs)
        complete = self._exchange("dispatch", records_layout, fields_in, plan.send_rows, shake.matrix, device)

        counts_pending.wait()
        got = got.cpu()
        per_expert = got[:, :experts_per_rank].sum(0)
        per_expert = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
        recv_chan = recv_channel_starts(got[:, experts_per_rank:]).to(device)

        rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = dispatch_outputs(rows, x, scales,
                                                                                               topk_idx)
        outputs = [t for t in (recv_x, recv_scales, recv_topk_idx, recv_topk_weights) if t is not None]
        outputs.append(recv_src_idx.unsqueeze(1))

        deliver = self._deliver(complete, records_layout, fields_in, plan, recv_counts, outputs)

        @self.agreement.deferred("dispatch")
        def finish() -> None:
            deliver()
            if recv_topk_idx is not None:
                idx, weights = recv_topk_idx[:num_recv], recv_topk_weights[:num_recv]
                idx.sub_(me * experts_per_rank)
                foreign = (idx < 0) | (idx >= experts_per_rank)
                idx.masked_fill_(foreign, -1)
                weights.masked_fill_(foreign, 0.0)
            fill_padding([recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx],
                          [0, 0, -1, 0.0, -1], num_recv)

        handle = self.complete_handle(NormalHandle(rank_prefix, chan_prefix.to(device), recv_chan, recv_src_idx,
                                                   layout.is_token_in_rank, plan.send_pos))
        expert_list = [] if num_worst_tokens > 0 else per_expert.tolist()
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_list, handle, finish)

    def complete_handle(self, handle: NormalHandle) -> NormalHandle:
        """A non-cached dispatch's handle, with DeepEP's internode fields when the group spans several
        nodes (collective then: ``internode.attach_internode``)."""
        if not self.topology.internode:
            return handle
        return attach_internode(self.transport, self.topology, handle, "dispatch")

    def agree_cached(self, x: torch.Tensor, scales: Optional[torch.Tensor], handle: NormalHandle,
                     config: Config) -> tuple[Handshake, list[int]]:
        """A cached dispatch's handshake and the rows this rank expects from each rank."""
        expected, expected_digests, prefix_digest = self._received_blocks(handle)
        fields = {**_x_fields(x, scales), Field.PREFIX_DIGEST: prefix_digest, **_ring_fields(config)}
        shake = self.agreement.handshake("dispatch", Op.CACHED_DISPATCH, fields, handle.plan.send_counts, expected,
                                         _X_FIELDS + (Field.PREFIX_DIGEST,) + self._rings, self.transport.device,
                                         sent_digests=handle.sent[1], expected_digests=expected_digests)
        return shake, expected

    def cached_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                        handle: NormalHandle, config: Config) -> DispatchResult:
        """Dispatch that reuses the routing of ``handle`` (see ``Buffer.dispatch``)."""
        device = x.device
        plan = handle.plan
        shake, expected = self.agree_cached(x, scales, handle, config)
        num_recv = sum(expected)
        specs = [("x", x.dtype, x.shape[1])] + ([] if scales is None else [("scales", scales.dtype, scales.shape[1])])
        records_layout = RecordLayout.build(specs)
        fields_in = [x] if scales is None else [x, scales]
        complete = self._exchange("dispatch", records_layout, fields_in, plan.send_rows, shake.matrix, device)
        rows = handle.recv_src_idx.shape[0]
        recv_x = empty((rows, x.shape[1]), x.dtype, device)
        recv_scales = None if scales is None else empty((rows, scales.shape[1]), scales.dtype, device)
        outputs = [recv_x] if recv_scales is None else [recv_x, recv_scales]
        deliver = self._deliver(complete, records_layout, fields_in, plan, expected, outputs)

        @self.agreement.deferred("dispatch")
        def finish() -> None:
            deliver()
            fill_padding([recv_x, recv_scales], [0, 0], num_recv)

        return DispatchResult(recv_x, recv_scales, None, None, None, None, finish)

    # ------------------------------------------------------------------ combine
    def agree_combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                      config: Config) -> tuple[Handshake, list[int], list[int]]:
        """A combine's handshake, the rows this rank returns to each rank and the rows it gets back."""
        # each received row goes back to its source; the rows each rank returns are the ones this rank sent it
        return_counts, return_digests, prefix_digest = self._received_blocks(handle)
        expected, expected_digests, _ = handle.sent
        fields = {Field.HIDDEN: x.shape[1], Field.X_DTYPE: WireDType.code(x.dtype),
                  Field.NUM_TOPK: -1 if topk_weights is None else topk_weights.shape[1],
                  Field.HAS_WEIGHTS: int(topk_weights is not None), Field.PREFIX_DIGEST: prefix_digest,
                  **_ring_fields(config)}
        shake = self.agreement.handshake("combine", Op.COMBINE, fields, return_counts, expected,
                                         (Field.HIDDEN, Field.X_DTYPE, Field.NUM_TOPK, Field.HAS_WEIGHTS,
                                          Field.PREFIX_DIGEST) + self._rings, self.transport.device,
                                         sent_digests=return_digests, expected_digests=expected_digests)
        return shake, return_counts, expected

    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Callable[[], None]]:
        """Combine of checked arguments (see ``Buffer.combine``): returns (out, out_weights, finish)."""
        me, device = self.rank, x.device
        shake, return_counts, expected = self.agree_combine(x, handle, topk_weights, config)
        num_return = sum(return_counts)
        specs = [("x", x.dtype, x.shape[1])]
        if topk_weights is not None:
            specs.append(("weights", torch.float32, topk_weights.shape[1]))
        records_layout = RecordLayout.build(specs)
        payload = [x] if topk_weights is None else [x, topk_weights]
        rows = torch.arange(num_return, dtype=torch.int64, device=device)
        # Records that are plain rows of x: this rank's own rows are reduced in place, not sent.
        direct = topk_weights is None and records_layout.record_bytes == x.shape[1] * x.element_size() \
            and x.is_contiguous()
        complete = self._exchange("combine", records_layout, payload, rows, shake.matrix, device, skip_self=direct)
        send_pos = handle.send_head
        if direct:
            send_pos = rows_within_destination(send_pos, expected)
            own_begin = sum(return_counts[:me])
            own = x[own_begin:own_begin + return_counts[me]].view(torch.uint8)  # a row is a record

        def sources(received: torch.Tensor) -> list[torch.Tensor]:
            """Each rank's returned records: in ``received`` (which skips this rank) or, for this
            rank, its own rows of x."""
            blocks, begin = [], 0
            for r, count in enumerate(expected):
                if r == me:
                    blocks.append(own)
                else:
                    blocks.append(received[begin:begin + count])
                    begin += count
            return blocks

        num_tokens = handle.is_token_in_rank.shape[0]
        out = empty((num_tokens, x.shape[1]), x.dtype, device)
        out_weights = None
        if topk_weights is not None:
            out_weights = torch.empty(num_tokens, topk_weights.shape[1], dtype=torch.float32, device=device)

        reduce = functools.partial(combine_reduce_by_node, topology=self.topology) if self.topology.internode \
            else combine_reduce

        @self.agreement.deferred("combine")
        def finish() -> None:
            complete(lambda received: reduce(records_layout, sources(received) if direct else received,
                                             send_pos, bias0, bias1, out, out_weights))

        return out, out_weights, finish


def _check_worst(shake: Handshake) -> None:
    """Every rank's ``num_worst_tokens`` (when set) holds the rows it receives."""
    worst = shake.field(Field.NUM_WORST_TOKENS)
    received = shake.sent.sum(0).tolist()
    over = [(r, received[r], w) for r, w in enumerate(worst) if 0 < w < received[r]]
    if over:
        shown = "; ".join(f"rank {r} receives {n} rows but num_worst_tokens={w}" for r, n, w in over)
        raise CrossRankMismatchError(f"dispatch: {shown}; num_worst_tokens must be at least the rows a rank "
                                     f"receives (num_tokens * num_ranks is always enough)")
