"""Normal mode on the CUDA kernels (``csrc/cuda/kernels/intranode.h``): the portable backend's
handshake agrees on the call (same checks, same errors), then the kernels move every byte.

    dispatch:  handshake -> notify kernel (counts into peers' cells, barrier, prefixes; checked
               against the handshake's counts) -> size outputs -> dispatch kernel (rings)
    combine:   handshake -> combine kernel (prologue barrier, rings, fixed-order fp32 sum)

Outputs are bitwise the portable backend's: rows by source rank then source token, sums over ranks
ascending. Launches run on the buffer's ``HostStream``: the call returns once the payload kernel is
launched, and ``finish()`` waits for it (notify, whose counts size the outputs, is waited for at once).

The same code drives the device build (``moe_comm._cuda``, the ``cuda`` backend): tensors the kernels
read and write are allocated on x's device, notify's outputs in memory the kernel writes and the host
reads right after the launch (``notify_outputs``: pinned host memory mapped into the GPU there), and
the handle's tensors on x's device, as the portable backend returns them.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ...core.config import Config
from ...core.native import NATIVE_DTYPES, native_dtype
from ...ops import DispatchLayout
from ...protocol.handle import NormalHandle
from ...protocol.normal_layout import channel_prefix, dispatch_outputs, rows_within_destination
from ..base import DispatchResult
from ..portable.normal import NormalMode
from .host_stream import HostStream
from .internode import KernelInternodeMode, kernels_span
from .kernel_outputs import cached_result, check_notify, finish_dispatch, kernel_topk_ids, pinned_inputs
from .pins import Pins
from .shared_buffers import SharedBuffers

__all__ = ["KernelNormalMode"]

#: ``notify_outputs(specs)``: one tensor per ``(shape, dtype)`` of ``specs``, in memory the notify kernel
#: writes and the host reads once the launch has returned (CPU tensors; their data_ptr is the kernel's address)
NotifyOutputs = Callable[[Sequence[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor]]


def host_notify_outputs(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The host build's notify outputs: fresh CPU tensors."""
    return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


def _channel_counts(starts: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` int64 rows per (source, channel), from each channel's first row and each source's total."""
    ends = torch.cat([starts[:, 1:], totals.unsqueeze(1)], dim=1)
    return (ends - starts).contiguous()


class KernelNormalMode:
    """Normal-mode operations of one Buffer on the kernels of ``kernels`` (moe_comm._cuda_host, or the
    device build's adapter ``device_kernels.DeviceKernels``); ``name``: the backend's, for messages."""

    def __init__(self, portable: NormalMode, kernels: Any, buffers: SharedBuffers, stream: HostStream,
                 timeout_s: float, notify_outputs: NotifyOutputs = host_notify_outputs,
                 name: str = "cuda_host", rdma_buffers: Optional[SharedBuffers] = None) -> None:
        self.portable, self.kernels, self.buffers, self.stream = portable, kernels, buffers, stream
        self.timeout_s = timeout_s
        self.notify_outputs, self.name = notify_outputs, name
        self.rank, self.num_ranks = portable.rank, portable.num_ranks
        self._epoch = 0  # barriers this buffer's ranks have passed together
        #: the two-hop kernels, when the group spans several full nodes (``buffers`` is then the NVL
        #: buffer of every rank, ``rdma_buffers`` the RDMA one); None: one node, or nodes of unequal size,
        #: where the intranode kernels dispatch and the portable backend combines
        self.internode = None
        if rdma_buffers is not None and kernels_span(portable.topology, kernels.MAX_NODES):
            self.internode = KernelInternodeMode(portable, kernels, buffers, rdma_buffers, stream, timeout_s,
                                                 notify_outputs, name)

    def _launcher(self, num_channels: int, config: Config, experts_per_rank: int, slot_bytes: int) -> Any:
        """The kernels' view of the buffers for this geometry, grown (collectively) when it needs more."""
        slots = config.num_max_nvl_chunked_recv_tokens
        need = self.kernels.normal_bytes(self.num_ranks, num_channels, experts_per_rank, slots, slot_bytes)
        if need > self.buffers.nbytes:  # the same on every rank: the sizes follow from agreed fields
            self.stream.synchronize()  # no launch may run on buffers being replaced
            self.buffers.ensure(need)
            self._epoch = 0  # fresh, zeroed buffers: the barrier counters start again
        return self.kernels.Normal(self.buffers.bases, self.buffers.pids, self.rank, self.timeout_s, num_channels,
                                   config.num_max_nvl_chunked_send_tokens, experts_per_rank, slots, slot_bytes)

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                 topk_weights: Optional[torch.Tensor], layout: DispatchLayout, expert_alignment: int,
                 num_worst_tokens: int, config: Config) -> DispatchResult:
        """Non-cached dispatch of checked arguments (see ``Buffer.dispatch``)."""
        if self.internode is not None:
            return self.internode.dispatch(x, scales, topk_idx, topk_weights, layout, expert_alignment,
                                           num_worst_tokens, config)
        R, me, pin, device = self.num_ranks, self.rank, Pins(), x.device
        plan, shake = self.portable.agree_dispatch(x, scales, topk_idx, layout, num_worst_tokens, config)
        C = config.num_channels
        local = layout.num_tokens_per_expert.numel() // R
        chan_prefix = channel_prefix(layout.is_token_in_rank, C)
        x, K = x.contiguous(), 0 if topk_idx is None else topk_idx.shape[1]
        scale_bytes = 0 if scales is None else scales.shape[1] * scales.element_size()
        slot = self.kernels.dispatch_slot_bytes(x.shape[1] * x.element_size(), scale_bytes, K)
        kernel = self._launcher(C, config, local, slot)

        i64 = torch.int64
        rank_prefix, recv_offset, per_expert, num_recv, chan_starts, chan_counts = self.notify_outputs(
            [((R, R), torch.int32), ((R,), i64), ((local,), i64), ((1,), i64), ((R, C), i64), ((R, C), i64)])
        sends = chan_prefix.to(torch.int64).contiguous()
        args = (self._next_epoch(), pin(layout.num_tokens_per_rank.to(device, torch.int64).contiguous()),
                pin(layout.num_tokens_per_expert.to(device, torch.int64).contiguous()), pin(sends), expert_alignment,
                pin(rank_prefix), pin(recv_offset), pin(chan_starts), pin(chan_counts), pin(per_expert), pin(num_recv))
        self.stream.run("dispatch", lambda: pin.launch(kernel.notify, *args))
        check_notify(me, "rank prefix matrix", rank_prefix, shake.sent.cumsum(0).to(torch.int32))
        received = int(num_recv)
        rows = num_worst_tokens if num_worst_tokens > 0 else received
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = dispatch_outputs(rows, x, scales,
                                                                                               topk_idx)
        idx64 = kernel_topk_ids(recv_topk_idx, device)
        args = (x.shape[0], x.shape[1] * x.element_size(), scale_bytes, K,
                *pinned_inputs(pin, x, scales, topk_idx, topk_weights), pin(layout.is_token_in_rank.contiguous()),
                pin(sends), pin(recv_offset), pin(chan_starts), pin(chan_counts), pin(recv_x), pin(recv_scales),
                pin(idx64), pin(recv_topk_weights), pin(recv_src_idx))
        job = self.stream.submit("dispatch", lambda: pin.launch(kernel.dispatch, *args))
        finish = finish_dispatch(self.portable.agreement, job, (recv_x, recv_scales, recv_topk_idx,
                                                                recv_topk_weights, recv_src_idx), idx64, received)

        # (on the host build .to(device) keeps notify's own tensors; the device build copies them out)
        handle = self.portable.complete_handle(NormalHandle(rank_prefix.to(device), chan_prefix,
                                                            chan_starts.to(torch.int32).to(device), recv_src_idx,
                                                            layout.is_token_in_rank, plan.send_pos))
        expert_list = [] if num_worst_tokens > 0 else per_expert.tolist()
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_weights, expert_list, handle, finish)

    def cached_dispatch(self, x: torch.Tensor, scales: Optional[torch.Tensor], handle: NormalHandle,
                        config: Config) -> DispatchResult:
        """Dispatch with the routing of ``handle`` (see ``Buffer.dispatch``)."""
        if self.internode is not None:
            return self.internode.cached_dispatch(x, scales, handle, config, self._received)
        self.portable.agree_cached(x, scales, handle, config)
        pin = Pins()
        C = handle.channel_prefix_matrix.shape[1]
        x = x.contiguous()
        scale_bytes = 0 if scales is None else scales.shape[1] * scales.element_size()
        kernel = self._launcher(C, config, 0, self.kernels.dispatch_slot_bytes(x.shape[1] * x.element_size(),
                                                                              scale_bytes, 0))
        recv_offset, chan_starts, chan_counts, received = self._received(handle, x.device)
        rows = handle.recv_src_idx.shape[0]
        recv_x, recv_scales, _, _, src_idx = dispatch_outputs(rows, x, scales, None)
        epoch = self._next_epoch()
        args = (x.shape[0], x.shape[1] * x.element_size(), scale_bytes, 0, pin(x),
                pin(None if scales is None else scales.contiguous()), 0, 0, pin(handle.is_token_in_rank.contiguous()),
                pin(handle.channel_prefix_matrix.to(x.device, torch.int64).contiguous()), pin(recv_offset),
                pin(chan_starts), pin(chan_counts), pin(recv_x), pin(recv_scales), 0, 0, pin(src_idx))
        job = self.stream.submit("dispatch", lambda: kernel.prologue(epoch) or pin.launch(kernel.dispatch, *args))
        return cached_result(self.portable.agreement, job, recv_x, recv_scales, received)

    def _row_type(self, dtype: torch.dtype) -> Any:
        """The kernels' ``DType`` of combine rows of ``dtype`` (raised after the handshake, which has
        checked that every rank's dtype is the same, so every rank raises alike)."""
        if dtype not in NATIVE_DTYPES:
            raise TypeError(f"combine: the {self.name} kernels sum {list(NATIVE_DTYPES)} rows, got x of dtype {dtype}")
        return native_dtype(dtype, self.kernels)

    def _received(self, handle: NormalHandle, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """From a handle: (first row of each source, first row of each (source, channel), rows per
        (source, channel), rows received), the tensors on ``device`` (where the kernel reads them)."""
        counts = torch.tensor(handle.recv_counts(self.rank), dtype=torch.int64)
        offsets = (counts.cumsum(0) - counts).contiguous()
        starts = handle.recv_channel_prefix_matrix.cpu().to(torch.int64).contiguous()
        return (offsets.to(device), starts.to(device), _channel_counts(starts, counts).to(device),
                int(counts.sum()))

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: NormalHandle, topk_weights: Optional[torch.Tensor],
                bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], config: Config
                ) -> tuple[torch.Tensor, Optional[torch.Tensor], Callable[[], None]]:
        """Combine of checked arguments (see ``Buffer.combine``): returns (out, out_weights, finish). Across
        full nodes the two-hop kernels combine; across nodes of unequal size the portable backend's combine
        sums (the intranode kernels' rings cannot give DeepEP's two-level order)."""
        if self.internode is None and self.portable.topology.internode:
            self.stream.synchronize()  # stream order: launches queued before this combine finish first
            return self.portable.combine(x, handle, topk_weights, bias0, bias1, config)
        if self.internode is not None:
            return self.internode.combine(x, handle, topk_weights, bias0, bias1, config, self._row_type,
                                          self._received)
        self.portable.agree_combine(x, handle, topk_weights, config)
        row_type = self._row_type(x.dtype)
        pin = Pins()
        C = handle.channel_prefix_matrix.shape[1]
        x, K = x.contiguous(), 0 if topk_weights is None else topk_weights.shape[1]
        x_bytes = x.shape[1] * x.element_size()
        kernel = self._launcher(C, config, 0, x_bytes + 4 * K)
        recv_offset, chan_starts, chan_counts, _ = self._received(handle, x.device)
        num_tokens = handle.is_token_in_rank.shape[0]
        out = torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=x.device)
        out_weights = None if topk_weights is None else torch.empty(num_tokens, K, dtype=torch.float32,
                                                                    device=x.device)
        epoch = self._next_epoch()
        args = (num_tokens, x.shape[1], x_bytes, K, row_type, pin(x),
                pin(None if topk_weights is None else topk_weights.to(torch.float32).contiguous()), pin(recv_offset),
                pin(chan_starts), pin(chan_counts), pin(handle.is_token_in_rank.contiguous()),
                pin(handle.channel_prefix_matrix.to(x.device, torch.int64).contiguous()),
                pin(rows_within_destination(handle.send_head.to(torch.int32), handle.sent[0]).contiguous()),
                pin(None if bias0 is None else bias0.contiguous()), pin(None if bias1 is None else bias1.contiguous()),
                pin(out), pin(out_weights))
        job = self.stream.submit("combine", lambda: kernel.prologue(epoch) or pin.launch(kernel.combine, *args))
        return out, out_weights, self.portable.agreement.deferred("combine")(job.wait)
