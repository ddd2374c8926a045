"""Prepared low-latency calls on the kernels (``PreparedLowLatency`` of every build: ``moe_comm._cuda_host``,
``moe_comm._cuda`` and ``moe_comm._cuda_nvshmem`` through ``device_kernels.DeviceKernels``;
``csrc/cuda/python/prepared_low_latency.h``): the call's fixed cost paid once per signature, as
``portable/prepared.py`` does over the shm transport. The ``cuda_host`` and ``cuda`` backends run this same
Python; on a GPU the native call also orders the comm stream after the caller's as the checked path's launches
do, and takes no call with statistics tensors (their adds run on the checked path).

The first call of a signature runs the checked path (``low_latency.KernelLowLatencyMode``); the prepared call
then holds its launch object, its call header's template and the outputs of both buffer halves, and every
later call of the signature is a key lookup and one native call per op half: the arguments read and checked
against the signature there, the header's call number written, the kernels' send launch (and, without a hook
or event, their receive launch). The kernels check the top-k ids and the handle and judge the headers, as on
the checked path; an error record is raised by the checked path's own code (``KernelLowLatencyMode._receive``),
so every message keeps one source. Arguments the prepared call does not take leave everything as it was.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...ops.fp8 import GROUP
from ...protocol.call_header import compare_mask
from ...protocol.codes import Field, Fp8Format, Op
from ...protocol.low_latency_layout import dispatch_outputs
from ..base import Receive
from .low_latency import _COMBINE_COMPARED, _DISPATCH_COMPARED, KernelLowLatencyMode

__all__ = ["KernelLowLatencyCalls", "PreparedKernelDispatch", "PreparedKernelCombine", "prepare_kernel_dispatch",
           "prepare_kernel_combine"]


class _Pending:
    """The receive half of the prepared call last sent on one buffer half."""

    def __init__(self, call: "PreparedKernelCall", half: int) -> None:
        self._call, self._half = call, half
        self.number = 0  # the kernels' call number (``KernelLowLatencyMode._calls``)
        self.record: Any = None  # the launches' error record when already known (a failed send, a blocking call)

    def finish(self) -> None:
        """The receive launch (unless its record is known); an error record, or header posts that waited for
        this half, go through the checked path's receive (``KernelLowLatencyMode._receive``)."""
        call, mode = self._call, self._call.mode
        record, self.record = self.record, None
        if record is None:
            record = call.native.receive(self._half)
        if record is not None or mode._after[self._half]:
            mode._receive(call.op, call.kernel, self.number, frozenset(), call.compare, lambda: record)


class PreparedKernelCall:
    """A low-latency dispatch or combine of one signature prepared on the kernels' host build."""

    op: str

    def __init__(self, mode: KernelLowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int,
                 num_experts: int, fp8_format: Optional[Fp8Format], hook: bool, async_finish: bool) -> None:
        """``fp8_format``: a dispatch's cast; None for a combine."""
        R, local = mode.num_ranks, num_experts // mode.num_ranks
        self.mode, self.agreement = mode, mode.agreement
        self.hook, self.blocking = hook, not hook and not async_finish
        self.kernel = mode._launcher(local, m, hidden, frozenset())
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m}
        if fp8_format is None:
            code, self.compare = Op.LOW_LATENCY_COMBINE, _COMBINE_COMPARED
            fields[Field.USE_LOGFMT] = 0
        else:
            code, self.compare = Op.LOW_LATENCY_DISPATCH, _DISPATCH_COMPARED
            fields[Field.FP8_FORMAT] = fp8_format
        header = self.agreement.header(code, fields, [0] * R, number=0)
        post = (0, header.numel(), int(Field.REJECTED), 8 * mode._width, compare_mask(self.compare))
        halves, self.results = [], []
        fp8 = fp8_format is not None and fp8_format is not Fp8Format.BF16
        if fp8_format is not None:
            num_scales = hidden // GROUP // (4 if fp8_format.ue8m0 else 1) if fp8 else 0
            scales = (torch.int32 if fp8_format.ue8m0 else torch.float32, num_scales) if fp8 else None
            for _ in range(2):
                recv_x, recv_scales, src_info, layout_range, recv_count = dispatch_outputs(
                    local, R, m, hidden, scales, mode.device)
                halves.append((recv_x.data_ptr(), 0 if recv_scales is None else recv_scales.data_ptr(),
                               src_info.data_ptr(), layout_range.data_ptr(), recv_count.data_ptr()))
                self.results.append((recv_x if recv_scales is None else (recv_x, recv_scales), recv_count,
                                     (src_info, layout_range, m, hidden, num_experts)))
        self.native = mode.kernels.PreparedLowLatency(
            self.kernel, header.data_ptr(), header.numel(), int(Field.CALL), post, num_experts, num_topk, fp8,
            fp8 and fp8_format.round_scale, fp8 and fp8_format.ue8m0, halves, key, torch)
        self.pending = (_Pending(self, 0), _Pending(self, 1))
        self._finish = tuple(self.agreement.deferred(self.op)(p.finish) for p in self.pending)
        #: the receive of the last call sent (its hook, or what its event runs)
        self.receive: Optional[Receive] = None
        self.stale = False  # (the kernels' buffers are mapped once: a prepared call never goes stale)

    def _start(self) -> int:
        """The buffer half of the next call when this prepared call may run it now, else -1 (the buffer
        refuses calls, a rank is masked, the half holds a result or header posts wait for it, or a launch of
        the checked path is still on the stream)."""
        mode, agreement = self.mode, self.agreement
        half = mode._idx
        receive, last = mode._slots[half].receive, mode.stream._last
        if agreement.broken is not None or agreement.destroyed or agreement.masked or mode._after[half] or \
                (receive is not None and not receive.done) or (last is not None and not last._seen):
            return -1
        return half

    def _sent(self, record: Any, half: int, number: int, call: int) -> None:
        """The bookkeeping of Buffer call ``number`` (the kernels' call ``call``) launched on ``half``, as the
        checked path keeps it; a blocking call's failure is raised here, a hooked one's by its receive."""
        mode = self.mode
        self.agreement.calls, mode._calls = number, call
        mode._idx, mode._lent = half ^ 1, None
        slot, pending = mode._slots[half], self.pending[half]
        pending.number, pending.record = call, record
        if self.blocking:
            slot.receive = None
            if record is not None:
                self._finish[half]()
            return
        self.receive = slot.receive = Receive(self.op, self._finish[half])
        slot.hook = self.hook


class PreparedKernelDispatch(PreparedKernelCall):
    """A prepared dispatch: ``send`` and ``results`` as ``portable.prepared.PreparedDispatch``'s."""

    op = "low_latency_dispatch"

    def send(self, key: tuple, x: Any, topk_idx: Any, recv_stats: Any, wait_stats: Any) -> int:
        """A dispatch with these (unchecked) arguments: its buffer half, or -1 for the checked path."""
        half = self._start()
        if half < 0:
            return -1
        number, call = self.agreement.calls + 1, self.mode._calls + 1
        taken, record = self.native.dispatch(key, x, topk_idx, recv_stats, wait_stats, number, call, self.blocking)
        if not taken:
            return -1
        self._sent(record, half, number, call)
        return half


class PreparedKernelCombine(PreparedKernelCall):
    """A prepared combine: ``send`` as ``portable.prepared.PreparedCombine``'s."""

    op = "low_latency_combine"

    def send(self, key: tuple, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, out: Any,
             wait_stats: Any) -> Optional[torch.Tensor]:
        """A combine with these (unchecked) arguments: its output, or None for the checked path."""
        half = self._start()
        if half < 0:
            return None
        number, call = self.agreement.calls + 1, self.mode._calls + 1
        taken, record, combined = self.native.combine(key, x, topk_idx, topk_weights, handle, out, wait_stats,
                                                      number, call, self.blocking)
        if not taken:
            return None
        self._sent(record, half, number, call)
        return combined


def _preparable(mode: KernelLowLatencyMode) -> bool:
    """Whether ``mode``'s calls can be prepared: their calls agree in the data path (not a shrinking buffer's,
    whose handshake comes first)."""
    return mode.agrees_in_data_path and not mode.agreement.shrink and hasattr(mode.kernels, "PreparedLowLatency")


def prepare_kernel_dispatch(mode: KernelLowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int,
                            num_experts: int, fp8_format: Fp8Format, hook: bool,
                            async_finish: bool) -> Optional["PreparedKernelDispatch"]:
    """A prepared dispatch for this signature (of checked arguments), or None where ``mode`` takes none."""
    if not _preparable(mode):
        return None
    return PreparedKernelDispatch(mode, key, hidden, num_topk, m, num_experts, fp8_format, hook, async_finish)


def prepare_kernel_combine(mode: KernelLowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int,
                           num_experts: int, hook: bool, async_finish: bool) -> Optional["PreparedKernelCombine"]:
    """A prepared combine for this signature (BF16 rows, not zero-copy), or None where ``mode`` takes none."""
    if not _preparable(mode):
        return None
    return PreparedKernelCombine(mode, key, hidden, num_topk, m, num_experts, None, hook, async_finish)


class KernelLowLatencyCalls:
    """What a backend on the kernels (``cuda_host``, ``cuda``) says of its low-latency calls, mixed in
    before ``PortableBackend``: its ``low_latency`` is a ``KernelLowLatencyMode``."""

    low_latency: KernelLowLatencyMode

    def reserve_low_latency(self, num_rdma_bytes: int) -> None:
        self.low_latency.reserve(num_rdma_bytes)

    @property
    def low_latency_checks_topk(self) -> bool:
        return self.low_latency.agrees_in_data_path

    def prepare_low_latency_dispatch(self, key: tuple, hidden: int, num_topk: int,
                                     num_max_dispatch_tokens_per_rank: int, num_experts: int, fp8_format: Fp8Format,
                                     hook: bool, async_finish: bool) -> Any:
        return prepare_kernel_dispatch(self.low_latency, key, hidden, num_topk, num_max_dispatch_tokens_per_rank,
                                       num_experts, fp8_format, hook, async_finish)

    def prepare_low_latency_combine(self, key: tuple, hidden: int, num_topk: int,
                                    num_max_dispatch_tokens_per_rank: int, num_experts: int, hook: bool,
                                    async_finish: bool) -> Any:
        return prepare_kernel_combine(self.low_latency, key, hidden, num_topk, num_max_dispatch_tokens_per_rank,
                                      num_experts, hook, async_finish)
