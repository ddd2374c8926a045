"""Low-latency mode on the CUDA kernels (``csrc/cuda/kernels/low_latency.h``): the portable backend's
handshake and double buffering (``portable.low_latency.LowLatencyMode``), the kernels' send and
receive launches for the bytes.

    dispatch:  handshake -> send launch (FP8 cast, slots into peers' halves, count signals)
               ...  receive (the hook, or at once): receive launch (counts, rows by source rank)
    combine:   handshake -> send launch (rows back to their sources, flags)
               ...  receive: receive launch (flags, weighted fixed-order sum)

Both halves of a call use buffer half ``idx`` of the portable mode's alternation, on every rank.
Outputs are bitwise the portable backend's. The same code drives the device build (``moe_comm._cuda``,
the ``cuda`` backend, through ``device_kernels.DeviceKernels``): every tensor a kernel reads or writes
is on x's device.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from ...core.memory import empty
from ...ops.fp8 import GROUP
from ...protocol.agreement import CallAgreement
from ...protocol.codes import Fp8Format
from ...protocol.handle import LowLatencyHandle
from ...protocol.low_latency_layout import add_stats, dispatch_outputs
from ...transport import Transport
from ..base import LowLatencyDispatch, Receive
from ..portable.low_latency import LowLatencyMode
from .host_stream import HostStream
from .pins import Pins
from .shared_buffers import SharedBuffers

__all__ = ["KernelLowLatencyMode"]



class KernelLowLatencyMode(LowLatencyMode):
    """Low-latency operations of one Buffer on the kernels of ``kernels`` (moe_comm._cuda_host, or the
    device build's adapter ``device_kernels.DeviceKernels``)."""

    agrees_in_data_path = False  # NOTES: the kernels' signals carry no call header yet: handshake first

    def __init__(self, transport: Transport, agreement: CallAgreement, kernels: Any,
                 buffers: SharedBuffers, stream: HostStream, timeout_s: float, node_ranks: int = 0) -> None:
        super().__init__(transport, agreement)
        self.kernels, self.buffers, self.stream, self.timeout_s = kernels, buffers, stream, timeout_s
        #: > 0: the ranks form nodes of this many, and the kernels reach other nodes' ranks as NVSHMEM
        #: does, putting from this rank's staging (the host build; its buffers are laid out for it)
        self.node_ranks = node_ranks

    def _launcher(self, local: int, m: int, hidden: int, skip: frozenset[int]) -> Any:
        need = self.kernels.low_latency_bytes(self.num_ranks, local, m, hidden)
        if need > self.buffers.nbytes:  # the same on every rank: the sizes follow from agreed fields
            self.stream.synchronize()  # no launch may run on buffers being replaced
            self.buffers.ensure(need, skip)
        unmapped = self.buffers.unmapped(skip)
        if unmapped:  # mapped while those ranks were masked; a kernel would write through address 0
            raise RuntimeError(f"low-latency call: ranks {unmapped} were masked when this rank's buffers were mapped "
                               f"and are not masked now; a rank masked while alive cannot rejoin this Buffer")
        return self.kernels.LowLatency(self.buffers.peers(range(self.num_ranks)), self.buffers.pids, self.rank,
                                       self.timeout_s, local, m, hidden, self.node_ranks)

    def _skip_mask(self, skip: frozenset[int], device: torch.device) -> torch.Tensor:
        """``[R]`` uint8 on ``device``: 1 for the ranks this call leaves out."""
        mask = torch.zeros(self.num_ranks, dtype=torch.uint8, device=device)
        mask[list(skip)] = 1
        return mask

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int, fp8_format: Fp8Format,
                 recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 hook: bool) -> LowLatencyDispatch:
        """Checked ``low_latency_dispatch`` (see ``Buffer``); returns outputs filled by ``receive``."""
        op = "low_latency_dispatch"
        R, hidden, pin = self.num_ranks, x.shape[1], Pins()
        local = num_experts // R
        slot = self._acquire(op)
        half = self._idx
        shake, _, _, waited = self.agree_dispatch(x, topk_idx, m, num_experts, fp8_format, self.skip())
        skip = shake.skip
        fp8 = fp8_format is not Fp8Format.BF16
        num_scales = (hidden // GROUP // (4 if fp8_format.ue8m0 else 1)) if fp8 else 0
        scales = (torch.int32 if fp8_format.ue8m0 else torch.float32, num_scales) if fp8 else None
        recv_x, recv_scales, src_info, layout_range, recv_count = dispatch_outputs(local, R, m, hidden, scales,
                                                                                   x.device)
        kernel = self._launcher(local, m, hidden, skip)
        mask, routable = self._skip_mask(skip, x.device), self._routable(topk_idx, num_experts, skip).to(torch.int64)
        args = (half, pin(mask), x.shape[0], 4 * num_scales, topk_idx.shape[1], fp8, fp8_format.round_scale,
                fp8_format.ue8m0, pin(x.contiguous()), pin(routable.contiguous()), pin(recv_x),
                # recv_scales is the transposed view of an [E_loc, S, R * M] allocation: its storage
                pin(None if recv_scales is None else recv_scales.transpose(1, 2)), pin(src_info), pin(layout_range),
                pin(recv_count))
        self.stream.submit(op, lambda: pin.launch(kernel.dispatch, False, *args))

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            self.stream.run(op, lambda: pin.launch(kernel.dispatch, True, *args))
            add_stats(recv_stats, recv_count, wait_stats, waited + time.perf_counter_ns() - begin)

        receive = self._launch(slot, op, finish, hook)
        handle = LowLatencyHandle(src_info, layout_range, m, hidden, num_experts)
        return LowLatencyDispatch(recv_x, recv_scales, recv_count, handle, receive)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                zero_copy: bool, out: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                hook: bool, use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        """Checked ``low_latency_combine`` (see ``Buffer``); returns (out, receive that fills it). With
        ``use_logfmt`` the kernels encode each row to LogFMT-10 and decode it in the sum (the bits of the
        portable mode's)."""
        op = "low_latency_combine"
        local, _, hidden = x.shape
        pin = Pins()
        slot = self._acquire(op, zero_copy)
        half = self._idx
        shake, _, handle, waited = self.agree_combine(x, topk_idx, handle, self.skip(), use_logfmt)
        skip = shake.skip
        source = slot.combine_buffer[:x.numel() * 2].view(torch.bfloat16).view(x.shape) if zero_copy else x
        num_tokens, num_topk = topk_idx.shape
        if out is None:
            out = empty((num_tokens, hidden), torch.bfloat16, x.device)
        kernel = self._launcher(local, handle.num_max_dispatch_tokens_per_rank, hidden, skip)
        routable = self._routable(topk_idx, handle.num_experts, skip).to(torch.int64)
        args = (half, pin(self._skip_mask(skip, x.device)), num_tokens, num_topk, pin(source.contiguous()),
                pin(handle.src_info.contiguous()), pin(handle.layout_range.contiguous()), pin(routable.contiguous()),
                pin(topk_weights.to(torch.float32).contiguous()), pin(out), use_logfmt)
        self.stream.submit(op, lambda: pin.launch(kernel.combine, False, *args))

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            self.stream.run(op, lambda: pin.launch(kernel.combine, True, *args))
            add_stats(None, None, wait_stats, waited + time.perf_counter_ns() - begin)

        return out, self._launch(slot, op, finish, hook)

    # ------------------------------------------------------------------ clean
    def clean(self, m: int, hidden: int, num_experts: int, device: torch.device) -> None:
        """DeepEP's ``clean_low_latency_buffer``: pending results settled, then this rank's signals and
        flags zeroed (before the portable mode's barrier, so no peer writes one first), then the barrier."""
        for slot in self._slots:
            self._settle("clean_low_latency_buffer", slot)
        self.stream.synchronize()
        self.buffers.zero_own()
        super().clean(m, hidden, num_experts, device)
