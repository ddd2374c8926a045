"""Prepared low-latency calls on the shm transport: a call's fixed cost paid once per signature.

The first call of a signature (M, E, format, hook or async, which stats tensors are given) runs the
checked path (``low_latency.py``); ``Buffer`` then asks for a prepared call, which keeps what that call
established (the record layout, the header template, every rank's data slots and flags, the outputs of
both buffer halves, as DeepEP's results live in its two buffers) in a native object
(``moe_comm._C.PreparedDispatch`` / ``PreparedCombine``, ``csrc/cpu/prepared.h``). Every later call of the
signature is a key lookup and one native call per op half, which checks what may differ between calls of
one signature (the tensors' metadata, the top-k ids, the handle's layout) and does the cast, the post, the
wait, the verdict and the unpack or the weighted sum:

    send:     send() -> native send (without hook or event: and its receive) -> the checked path's
              bookkeeping (call number, buffer half, exchange number, the pending receive)
    receive:  the hook or event -> native receive

Nothing changes on the wire: a rank on a prepared call and a rank on the checked path meet in one call.
Arguments the prepared call does not take (another shape, an id out of range, a tensor elsewhere) leave
everything as it was (``NOT_TAKEN``): the checked path then runs the call and words the error. A receive
that cannot finish natively (a wait that failed, headers that differ) is judged by the checked path's own
receive (``_PostedCall``), so every error keeps one source.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...core.native import cpu_threads, native
from ...ops.records import RecordLayout
from ...protocol.call_header import compare_mask
from ...protocol.codes import Field, Fp8Format, Op
from ...protocol.low_latency_layout import dispatch_outputs, dispatch_record_layout
from ...transport import Transport
from ..base import Receive
from .low_latency import _COMPARED, LowLatencyMode, _PostedCall

__all__ = ["PreparedDispatch", "PreparedCombine", "prepare_dispatch", "prepare_combine", "shm_plan"]

#: how far a prepared call's half got (``moe_comm._C.PreparedStatus``, as ints)
_OK, _NOT_TAKEN, _POST_FAILED = 0, 1, 2


class _Pending(_PostedCall):
    """A prepared call's receive half while it waits for its hook or event: one of the mode's posted calls
    (``LowLatencyMode._unsettled``) and what holds the call's data slot (``ShmTransport.posted``), so the
    checked path settles it in post order, and receives it before it reuses the slot, as its own calls."""

    def __init__(self, call: "_Prepared", half: int) -> None:
        super().__init__(call.mode, call.op, None, call.compare, 0)  # type: ignore[arg-type]
        self._call, self._half = call, half
        self.released = True
        self._seq = 0

    def _run(self) -> None:
        try:
            self._call.receive_half(self._half, self._number, self._seq)
            self._result = ()  # type: ignore[assignment]
        except BaseException as exc:
            self._failed(exc)
        finally:
            self.released = True

    def release(self) -> None:
        """(The native receive, or the checked one it fell back to, frees the slot.)"""

    def spill(self) -> None:
        """The transport reuses this call's data slot: the call is received first."""
        self.settle(raise_error=False)


class _Prepared:
    """What a prepared dispatch and combine share: the mode whose bookkeeping they keep, their signature,
    and the receive halves of their pending calls."""

    op: str
    compare: tuple[Field, ...]

    def __init__(self, mode: LowLatencyMode, key: tuple, hook: bool, async_finish: bool, record_bytes: int,
                 header: torch.Tensor) -> None:
        self.mode, self.agreement, self.transport = mode, mode.agreement, mode.transport
        self.key, self.hook, self.blocking = key, hook, not hook and not async_finish
        self.header_bytes, self.record_bytes = header.numel(), record_bytes
        self.pending = (_Pending(self, 0), _Pending(self, 1))
        self._finish = tuple(self.agreement.deferred(self.op)(p.settle) for p in self.pending)
        #: the receive of the last call sent (its hook, or what its event runs)
        self.receive: Optional[Receive] = None
        #: the transport mapped its segments again: this call's addresses are stale (prepare a new one)
        self.stale = False
        self.plan, self.mapping = shm_plan(self.transport, header, record_bytes, self.compare)

    def _start(self) -> tuple[int, int]:
        """(buffer half, exchange number) of the next call when this prepared call may run it now; exchange 0
        when the checked path must (the buffer refuses calls, a rank is masked, the half or the data slot
        still holds a result, the transport's segments moved)."""
        mode, agreement = self.mode, self.agreement
        half = mode._idx
        receive = mode._slots[half].receive
        if agreement.broken is not None or agreement.destroyed or agreement.masked or \
                (receive is not None and not receive.done):
            return half, 0
        seq = self.transport.next_post(self.mapping)
        self.stale = seq == 0 and self.mapping != self.transport.mapping
        return half, seq

    def _sent(self, status: int, half: int, number: int, seq: int) -> None:
        """The bookkeeping of call ``number``, sent natively as exchange ``seq`` on ``half``, as the checked path
        keeps it; then its failure, if it failed."""
        mode = self.mode
        self.agreement.calls = number
        mode._idx, mode._lent = half ^ 1, None
        slot = mode._slots[half]
        if self.blocking:
            slot.receive = None
            self.transport.posted(seq, None)
        else:
            pending = self.pending[half]  # now the receive half of this call
            pending._number, pending._seq, pending._error, pending._result, pending.released = number, seq, None, \
                None, False
            self.transport.posted(seq, pending)
            mode._unsettled.append(pending)
            self.receive = slot.receive = Receive(self.op, self._finish[half])
            slot.hook = self.hook
        if status != _OK:
            self._failed(status, half, number, seq)

    def receive_half(self, half: int, number: int, seq: int) -> None:
        """The receive half of call ``number`` (exchange ``seq``) on ``half``."""
        if self.native.receive(half) != _OK:
            self._judged(half, number, seq)

    def _failed(self, status: int, half: int, number: int, seq: int) -> None:
        """Raises for a call whose native half failed: a post whose flow-control wait failed (the buffer
        breaks, as the checked path's), or a blocking call's receive (``_judged``)."""
        if status == _POST_FAILED:
            index, outcome = self.native.failure
            try:
                self.transport.post_failed(seq % 2, seq, index, outcome, self.op)
            except BaseException as exc:
                self.agreement.failed_started(self.op, number, exc)
                raise
        self._judged(half, number, seq)

    def _judged(self, half: int, number: int, seq: int) -> None:
        """A receive that did not finish natively, judged by the checked path's receive of the same post (its
        deadline spent: it only looks again): its error, the same on every rank; or, when the rows came after
        all, received natively."""
        post = self.transport.posted_call(seq % 2, seq, self.op, self.header_bytes, self.record_bytes)
        checked = _PostedCall(self.mode, self.op, post, self.compare, number)
        checked._run()
        if checked._error is not None:
            raise checked._error
        if self.native.receive(half) != _OK:
            raise AssertionError(f"{self.op}: call {number}'s headers agree in Python but not natively")

    native: Any


class PreparedDispatch(_Prepared):
    """A low-latency dispatch prepared for one signature; ``results[half]``: DeepEP's ``(recv_x, recv_count,
    handle)`` of a call on that buffer half."""

    op = "low_latency_dispatch"
    compare = _COMPARED + (Field.FP8_FORMAT,)

    def __init__(self, mode: LowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int, num_experts: int,
                 fp8_format: Fp8Format, hook: bool, async_finish: bool) -> None:
        R = mode.num_ranks
        records = dispatch_record_layout(hidden, fp8_format)
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m,
                  Field.FP8_FORMAT: fp8_format}
        header = mode.agreement.header(Op.LOW_LATENCY_DISPATCH, fields, [0] * R, number=0)
        super().__init__(mode, key, hook, async_finish, records.record_bytes, header)
        geometry = native().DispatchGeometry()
        geometry.num_experts, geometry.num_max_tokens, geometry.hidden, geometry.num_topk = num_experts, m, hidden, \
            num_topk
        geometry.fp8, geometry.round_scale, geometry.ue8m0 = fp8_format is not Fp8Format.BF16, \
            fp8_format.round_scale, fp8_format.ue8m0
        geometry.x_offset, geometry.src_offset = records.field("x").offset, records.field("src").offset
        geometry.expert_offset = records.field("expert").offset
        if geometry.fp8:
            scales = records.field("scales")
            geometry.scales_offset, geometry.num_scales, geometry.scale_bytes = scales.offset, scales.num_cols, \
                scales.dtype.itemsize
        halves, self.results = [], []
        for recv_x, recv_scales, src_info, layout_range, recv_count in _outputs(mode, m, hidden, num_experts,
                                                                                  fp8_format):
            strides = (0, 0, 0) if recv_scales is None else \
                tuple(s * recv_scales.element_size() for s in recv_scales.stride())
            halves.append((recv_x.data_ptr(), 0 if recv_scales is None else recv_scales.data_ptr(), strides,
                           src_info.data_ptr(), layout_range.data_ptr(), recv_count.data_ptr()))
            self.results.append((recv_x if recv_scales is None else (recv_x, recv_scales), recv_count,
                                 (src_info, layout_range, m, hidden, num_experts)))
        self.native = native().PreparedDispatch(self.plan, geometry, halves, key, torch)

    def send(self, key: tuple, x: Any, topk_idx: Any, recv_stats: Any, wait_stats: Any) -> int:
        """The call with these (unchecked) arguments: its buffer half, or -1 when the checked path must run it
        (nothing happened then)."""
        half, seq = self._start()
        if not seq:
            return -1
        number = self.agreement.calls + 1
        status = self.native.send(key, x, topk_idx, recv_stats, wait_stats, number, seq, seq % 2, half, self.blocking)
        if status == _NOT_TAKEN:
            return -1
        self._sent(status, half, number, seq)
        return half


class PreparedCombine(_Prepared):
    """A low-latency combine prepared for one signature (BF16 rows, not zero-copy)."""

    op = "low_latency_combine"
    compare = _COMPARED + (Field.USE_LOGFMT,)

    def __init__(self, mode: LowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int, num_experts: int,
                 hook: bool, async_finish: bool) -> None:
        R = mode.num_ranks
        records = RecordLayout.build([("x", torch.bfloat16, hidden)])
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m,
                  Field.USE_LOGFMT: 0}
        header = mode.agreement.header(Op.LOW_LATENCY_COMBINE, fields, [0] * R, number=0)
        super().__init__(mode, key, hook, async_finish, records.record_bytes, header)
        geometry = native().CombineGeometry()
        geometry.num_experts, geometry.num_max_tokens, geometry.hidden, geometry.num_topk = num_experts, m, hidden, \
            num_topk
        self.native = native().PreparedCombine(self.plan, geometry, key, torch)

    def send(self, key: tuple, x: Any, topk_idx: Any, topk_weights: Any, handle: Any, out: Any,
             wait_stats: Any) -> Optional[torch.Tensor]:
        """The call with these (unchecked) arguments: its output (filled by its receive), or None when the
        checked path must run it (nothing happened then)."""
        half, seq = self._start()
        if not seq:
            return None
        number = self.agreement.calls + 1
        status, combined = self.native.send(key, x, topk_idx, topk_weights, handle, out, wait_stats, number, seq,
                                            seq % 2, half, self.blocking)
        if status == _NOT_TAKEN:
            return None
        self._sent(status, half, number, seq)
        return combined


def shm_plan(transport: Transport, header: torch.Tensor, record_bytes: int, compare: tuple[Field, ...],
             metadata: bool = False) -> tuple[Any, int]:
    """(``moe_comm._C.ShmPostPlan`` of a prepared call whose headers are ``header`` (its template: the call number
    and the per-rank words are each call's) and records ``record_bytes``, compared on ``compare``; with
    ``metadata`` the metadata cells too (normal mode's count exchange); the transport's mapping it holds)."""
    slots, pids, capacity, rows_at, room, mapping = transport.prepared_plan(header.numel(), record_bytes)
    plan = native().ShmPostPlan()
    plan.num_ranks, plan.me, plan.timeout_s = transport.num_ranks, transport.rank, transport.timeout_s
    plan.pids, plan.slot_bytes, plan.rows_at, plan.room = pids, capacity, rows_at, room
    plan.header_bytes, plan.record_bytes = header.numel(), record_bytes
    plan.call_word, plan.rejected_word, plan.per_rank_word = int(Field.CALL), int(Field.REJECTED), len(Field)
    plan.compare, plan.num_threads = compare_mask(compare), cpu_threads()
    plan.set_header(header.data_ptr(), header.numel())  # copied: no host read of tensor data
    for k, (bases, consumed, arrived, mine) in enumerate(slots):
        plan.set_slot(k, bases, consumed, arrived, mine)
    if metadata:
        cells, plan.cell_bytes = transport.metadata_plan()
        for k, addresses in enumerate(cells):
            plan.set_meta_slot(k, *addresses)
    return plan, mapping


def _preparable(mode: LowLatencyMode) -> bool:
    """Whether ``mode`` takes prepared calls: its calls agree in the data path over a transport that posts
    natively to every rank (shm, one host), and do not shrink (whose handshake comes first)."""
    return mode.agrees_in_data_path and not mode.agreement.shrink and \
        mode.transport.prepared_plan(0, 8) is not None


def _outputs(mode: LowLatencyMode, m: int, hidden: int, num_experts: int, fp8_format: Fp8Format) -> list[tuple]:
    """The dispatch outputs of both buffer halves for this geometry, shared by every prepared dispatch of it
    (as DeepEP's two buffers are), made as padding (no row received: zeros, src_info -1, counts 0). A receive
    into a half then clears only the rows an earlier call filled past its own counts (``low_latency_unpack``'s
    ``padded``): at a decode shape most rows of a half are padding, and stay so."""
    key = (m, hidden, num_experts, fp8_format)
    found = mode.prepared_outputs.get(key)
    if found is None:
        fp8 = fp8_format is not Fp8Format.BF16
        scales = None
        if fp8:
            f = dispatch_record_layout(hidden, fp8_format).field("scales")
            scales = (f.dtype, f.num_cols)
        found = mode.prepared_outputs[key] = [
            dispatch_outputs(num_experts // mode.num_ranks, mode.num_ranks, m, hidden, scales, torch.device("cpu"))
            for _ in range(2)]
        for recv_x, recv_scales, src_info, layout_range, recv_count in found:
            recv_x.view(torch.uint8).zero_()
            if recv_scales is not None:
                recv_scales.zero_()
            src_info.fill_(-1)
            layout_range.zero_()
            recv_count.zero_()
    return found


def prepare_dispatch(mode: LowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int, num_experts: int,
                     fp8_format: Fp8Format, hook: bool, async_finish: bool) -> Optional[PreparedDispatch]:
    """A prepared dispatch for this signature (of checked arguments), or None where ``mode`` takes none."""
    if not _preparable(mode):
        return None
    return PreparedDispatch(mode, key, hidden, num_topk, m, num_experts, fp8_format, hook, async_finish)


def prepare_combine(mode: LowLatencyMode, key: tuple, hidden: int, num_topk: int, m: int, num_experts: int,
                    hook: bool, async_finish: bool) -> Optional[PreparedCombine]:
    """A prepared combine for this signature (of checked arguments, BF16 rows, not zero-copy), or None where
    ``mode`` takes none."""
    if not _preparable(mode):
        return None
    return PreparedCombine(mode, key, hidden, num_topk, m, num_experts, hook, async_finish)
