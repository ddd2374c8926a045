"""Normal mode across nodes on the CUDA kernels (``csrc/cuda/kernels/internode.h``): DeepEP's two hops.
The portable backend's handshake agrees on the call (same checks, same errors); then the kernels move
every byte, each token crossing between nodes once per destination node (RDMA rings, to the rank of
its local index there), then over that node's rings (NVLink) to its ranks:

    dispatch:  handshake -> notify kernel (counts over the rail, then the node; checked against the
               handshake's) -> size outputs -> dispatch kernel (RDMA senders, forwarders, NVL receivers)
    combine:   handshake -> prologue -> combine kernel (NVL senders, forwarders summing each node's rows,
               receivers summing the nodes' partials)

Outputs are bitwise the portable backend's: rows by global source rank then token, and DeepEP's
two-level combine sum (``ops.node_reduce``). The handle's internode fields are the portable backend's
(``portable.internode.attach_internode``); the kernels read their routing from them (the forwarders'
destination bits from ``send_nvl_head``, the receivers' ring positions from ``send_rdma_head``), and
notify's forwarding counts are checked against them. Every rank keeps two buffers, as on the GPU: the
NVL buffer its node's ranks map, and the RDMA buffer its rail reaches (``rdma_buffers``: here shared
memory, so the host build's link writes peers' memory directly, puts as copies plus signals).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...core.checks import check_tensor
from ...core.config import Config
from ...core.errors import bad_argument
from ...core.topology import Topology
from ...ops import DispatchLayout
from ...protocol.handle import NormalHandle
from ...protocol.internode_layout import forward_bits, rdma_channel_prefix
from ...protocol.normal_layout import channel_prefix, dispatch_outputs
from ..base import DispatchResult
from ..portable.normal import NormalMode
from .host_stream import HostStream
from .kernel_outputs import cached_result, check_notify, finish_dispatch, kernel_topk_ids, pinned_inputs
from .pins import Pins
from .shared_buffers import SharedBuffers

__all__ = ["KernelInternodeMode", "kernels_span"]

#: ``received(handle, device)``: (first row of each source, first row of each (source, channel), rows per
#: (source, channel), rows received) of a handle, the tensors on ``device`` (``KernelNormalMode._received``)
Received = Callable[[NormalHandle, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]


def kernels_span(topology: Topology, max_nodes: int) -> bool:
    """Whether the internode kernels serve ``topology``: several nodes, all of one size (DeepEP's rule:
    every node holds ``ranks_per_node`` ranks), at most ``max_nodes`` of them."""
    return topology.internode and topology.num_ranks % topology.ranks_per_node == 0 and \
        topology.num_nodes <= max_nodes


def _i64(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, torch.int64).contiguous()


class KernelInternodeMode:
    """Normal-mode operations across nodes of one Buffer on the kernels of ``kernels`` (its ``Internode``
    class); ``nvl_buffers`` and ``rdma_buffers`` hold every rank's two buffers, mapped here."""

    def __init__(self, portable: NormalMode, kernels: Any, nvl_buffers: SharedBuffers, rdma_buffers: SharedBuffers,
                 stream: HostStream, timeout_s: float, notify_outputs: Callable, name: str) -> None:
        self.portable, self.kernels, self.stream, self.timeout_s = portable, kernels, stream, timeout_s
        self.nvl_buffers, self.rdma_buffers = nvl_buffers, rdma_buffers
        self.notify_outputs, self.name = notify_outputs, name
        self.topology = portable.topology
        self.rank, self.num_ranks = portable.rank, portable.num_ranks
        # Launches of this buffer: barrier numbers only grow, also over fresh buffers (a rank's counters
        # start at 0, below any number a peer stores), so neither buffer's growth restarts them.
        self._epoch = 0

    def _launcher(self, config: Config, experts_per_rank: int, nvl_slot: int, rdma_slot: int) -> Any:
        """The kernels' view of both buffers for this geometry, grown (collectively) when they need more."""
        topo, C = self.topology, config.num_channels
        nvl_slots, rdma_slots = config.num_max_nvl_chunked_recv_tokens, config.num_max_rdma_chunked_recv_tokens
        nvl_need, rdma_need = self.kernels.internode_bytes(topo.num_nodes, topo.ranks_per_node, C, experts_per_rank,
                                                           nvl_slots, nvl_slot, rdma_slots, rdma_slot)
        if nvl_need > self.nvl_buffers.nbytes or rdma_need > self.rdma_buffers.nbytes:  # the same on every rank
            self.stream.synchronize()  # no launch may run on buffers being replaced
            self.nvl_buffers.ensure(nvl_need)
            self.rdma_buffers.ensure(rdma_need)
        node, local = topo.node_of(self.rank), topo.local_of(self.rank)
        nvl = self.nvl_buffers.peers([topo.rank_at(node, l) for l in range(topo.ranks_per_node)])
        rdma = self.rdma_buffers.peers([topo.rank_at(n, local) for n in range(topo.num_nodes)])
        return self.kernels.Internode(nvl, rdma, self.nvl_buffers.pids, self.rank, self.timeout_s, C,
                                      config.num_max_nvl_chunked_send_tokens, config.num_max_rdma_chunked_send_tokens,
                                      experts_per_rank, nvl_slots, nvl_slot, rdma_slots, rdma_slot)

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def _check_fields(self, op: str, handle: NormalHandle) -> None:
        """The internode fields the kernels index by (a handle's tensors can be changed in place): the
        forwarded tokens per channel, a prefix whose totals are the rows of ``send_nvl_head`` (the
        forwarders index its bits by them), and ``send_rdma_head`` of the handle's shape."""
        f, topo = handle.internode, self.topology
        C = handle.channel_prefix_matrix.shape[1]
        prefix = f.recv_rdma_channel_prefix_matrix
        check_tensor(op, "handle[3] (recv_rdma_channel_prefix_matrix)", prefix, shape=(topo.num_nodes, C),
                     dtype=torch.int32)
        check_tensor(op, "handle[8] (send_rdma_head)", f.send_rdma_head,
                     shape=(handle.is_token_in_rank.shape[0], topo.num_nodes), dtype=torch.int32)
        rows = f.send_nvl_head.shape[0]
        p = prefix.cpu().to(torch.int64)
        if bool((p.diff(dim=1, prepend=torch.zeros(p.shape[0], 1, dtype=torch.int64)) < 0).any()) or \
                int(p[:, -1].sum()) != rows:
            bad_argument(op, "handle[3] (recv_rdma_channel_prefix_matrix)", f"a prefix over channels (non-decreasing "
                         f"rows) whose totals add up to the {rows} rows of handle[9] (send_nvl_head)", p.tolist())

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], layout: DispatchLayout, expert_alignment: int,
                 num_worst_tokens: int, config: Config) -> DispatchResult:
        """Non-cached dispatch of checked arguments (see ``Buffer.dispatch``)."""
        R, me, pin, device, topo = self.num_ranks, self.rank, Pins(), x.device, self.topology
        plan, shake = self.portable.agree_dispatch(x, scales, topk_idx, layout, num_worst_tokens, config)
        C, Rn = config.num_channels, topo.num_nodes
        local = layout.num_tokens_per_expert.numel() // R
        chan_prefix = channel_prefix(layout.is_token_in_rank, C)
        rdma_prefix = _i64(rdma_channel_prefix(layout.is_token_in_rank, topo, C), device)
        x, K = x.contiguous(), 0 if topk_idx is None else topk_idx.shape[1]
        scale_bytes = 0 if scales is None else scales.shape[1] * scales.element_size()
        slot = self.kernels.dispatch_slot_bytes(x.shape[1] * x.element_size(), scale_bytes, K)
        kernel = self._launcher(config, local, slot, slot + 4)  # an RDMA slot adds the destination bits

        i64 = torch.int64
        gbl_prefix, recv_offset, chan_starts, chan_counts, recv_rdma, per_expert, num_recv = self.notify_outputs(
            [((R,), torch.int32), ((R,), i64), ((R, C), i64), ((R, C), i64), ((Rn, C), i64), ((local,), i64),
             ((1,), i64)])
        sends = _i64(chan_prefix, device)
        args = (self._next_epoch(), pin(_i64(layout.num_tokens_per_rank, device)),
                pin(_i64(layout.num_tokens_per_expert, device)), pin(sends), pin(rdma_prefix), expert_alignment,
                pin(gbl_prefix), pin(recv_offset), pin(chan_starts), pin(chan_counts), pin(recv_rdma),
                pin(per_expert), pin(num_recv))
        self.stream.run("dispatch", lambda: pin.launch(kernel.notify, *args))
        check_notify(me, "received-row prefix", gbl_prefix, shake.sent[:, me].cumsum(0).to(torch.int32))
        received = int(num_recv)
        rows = num_worst_tokens if num_worst_tokens > 0 else received
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = dispatch_outputs(rows, x, scales,
                                                                                               topk_idx)
        idx64 = kernel_topk_ids(recv_topk_idx, device)
        args = (x.shape[0], x.shape[1] * x.element_size(), scale_bytes, K,
                *pinned_inputs(pin, x, scales, topk_idx, topk_weights), pin(layout.is_token_in_rank.contiguous()),
                pin(rdma_prefix), pin(recv_rdma), pin(recv_offset), pin(chan_starts), pin(chan_counts), pin(recv_x),
                pin(recv_scales), pin(idx64), pin(recv_topk_weights), pin(recv_src_idx))
        job = self.stream.submit("dispatch", lambda: pin.launch(kernel.dispatch, *args))
        finish = finish_dispatch(self.portable.agreement, job, (recv_x, recv_scales, recv_topk_idx,
                                                                recv_topk_weights, recv_src_idx), idx64, received)

        rank_prefix = shake.sent.cumsum(0).to(torch.int32).to(device)
        handle = self.portable.complete_handle(NormalHandle(rank_prefix, chan_prefix, chan_starts.to(torch.int32)
                                                            .to(device), recv_src_idx, layout.is_token_in_rank,
                                                            plan.send_pos))
        check_notify(me, "forwarded-token prefix", recv_rdma, handle.internode.recv_rdma_channel_prefix_matrix
                           .to(i64))
        expert_list = [] if num_worst_tokens > 0 else per_expert.tolist()
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_list, handle, finish)

    def cached_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], handle: NormalHandle,
                        config: Config, received: Received) -> DispatchResult:
        """Dispatch with the routing of ``handle`` (see ``Buffer.dispatch``); ``received``: the handle's
        receive offsets (``KernelNormalMode._received``)."""
        self._check_fields("dispatch", handle)
        self.portable.agree_cached(x, scales, handle, config)
        pin, device, fields = Pins(), x.device, handle.internode
        x = x.contiguous()
        scale_bytes = 0 if scales is None else scales.shape[1] * scales.element_size()
        slot = self.kernels.dispatch_slot_bytes(x.shape[1] * x.element_size(), scale_bytes, 0)
        kernel = self._launcher(config, 0, slot, slot + 4)
        recv_offset, chan_starts, chan_counts, num_recv = received(handle, device)
        recv_x, recv_scales, _, _, src_idx = dispatch_outputs(handle.recv_src_idx.shape[0], x, scales, None)
        epoch = self._next_epoch()
        args = (x.shape[0], x.shape[1] * x.element_size(), scale_bytes, 0, pin(x),
                pin(None if scales is None else scales.contiguous()), 0, 0, pin(handle.is_token_in_rank.contiguous()),
                pin(_i64(fields.rdma_channel_prefix_matrix, device)),
                pin(_i64(fields.recv_rdma_channel_prefix_matrix, device)), pin(recv_offset), pin(chan_starts),
                pin(chan_counts), pin(recv_x), pin(recv_scales), 0, 0, pin(src_idx))
        job = self.stream.submit("dispatch", lambda: kernel.prologue(epoch) or pin.launch(kernel.dispatch, *args))
        return cached_result(self.portable.agreement, job, recv_x, recv_scales, num_recv)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], config: Config,
                row_type: Callable[[torch.dtype], Any], received: Received
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Callable[[], None]]:
        """Combine of checked arguments (see ``Buffer.combine``); ``row_type(dtype)``: the kernels' ``DType``
        of x's rows (raising for one they cannot sum). Returns (out, out_weights, finish)."""
        self._check_fields("combine", handle)
        self.portable.agree_combine(x, handle, topk_weights, config)
        rows = row_type(x.dtype)
        pin, device, fields = Pins(), x.device, handle.internode
        x, K = x.contiguous(), 0 if topk_weights is None else topk_weights.shape[1]
        x_bytes = x.shape[1] * x.element_size()
        kernel = self._launcher(config, 0, x_bytes + 4 * K, x_bytes + 4 * K)
        recv_offset, chan_starts, chan_counts, _ = received(handle, device)
        num_tokens = handle.is_token_in_rank.shape[0]
        out = torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=device)
        out_weights = None if topk_weights is None else torch.empty(num_tokens, K, dtype=torch.float32, device=device)
        bits = forward_bits(fields.send_nvl_head, self.topology.ranks_per_node).to(device)
        epoch = self._next_epoch()
        args = (num_tokens, x.shape[1], x_bytes, K, rows, pin(x),
                pin(None if topk_weights is None else topk_weights.to(torch.float32).contiguous()), pin(recv_offset),
                pin(chan_starts), pin(chan_counts), pin(_i64(fields.recv_rdma_channel_prefix_matrix, device)),
                pin(bits), pin(fields.send_rdma_head.to(device, torch.int32).contiguous()),
                pin(None if bias0 is None else bias0.contiguous()), pin(None if bias1 is None else bias1.contiguous()),
                pin(out), pin(out_weights))
        job = self.stream.submit("combine", lambda: kernel.prologue(epoch) or pin.launch(kernel.combine, *args))
        return out, out_weights, self.portable.agreement.deferred("combine")(job.wait)
