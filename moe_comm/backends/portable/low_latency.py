"""Low-latency mode: DeepEP's decode-time dispatch and combine with fixed shapes, over any transport.

    dispatch:  checks -> send order -> FP8 cast -> post the records and this call's header to every rank
               ...   receive: every rank's header -> verdict -> scatter into [E_loc, R * M, H]
    combine:   checks -> routing digests -> post the valid rows and the header
               ...   receive: headers -> verdict -> weighted fixed-order reduce per token

The send half waits for no peer: the call agreement travels with the data (``Transport.post``,
``protocol/call_header.py``), and the receive half, in ``hook()``, in ``event.current_stream_wait()`` or
at once, judges every rank's header before it reads a row, so a mismatch fails the same way on every
rank and a rank that rejected its arguments (it still posts its header, with its reason) fails every
rank's call. A shrinking buffer (``enable_shrink``) keeps the handshake first: it masks late ranks there.

Row order is deterministic (DeepEP's is arrival order): inside local expert e, rows come in blocks
by source rank ascending and, inside a block, by source token ascending. Rows past ``recv_count[e]``
are zero (``src_info`` -1), so whole outputs are bitwise reproducible: the receive writes them (the
outputs are recycled memory, ``core.memory.empty``: fresh zero pages fault on first touch, which costs
more than the zeros).

Double buffering: like DeepEP, calls alternate between two buffers. A call whose buffer still holds
a result that its hook has not received raises instead of overwriting it, and a zero-copy combine
raises unless the buffer it reads was lent by ``get_next_low_latency_combine_buffer`` right before.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...core.errors import CommTimeoutError, bad_argument
from ...core.memory import empty
from ...ops import quantize
from ...ops.combine_reduce import combine_reduce
from ...ops.logfmt import logfmt_encode, logfmt_row_bytes
from ...ops.records import RecordLayout, native_segments, pack_rows
from ...protocol.agreement import CallAgreement, is_agreed, no_rows
from ...protocol.call_header import decode, header_bytes
from ...protocol.codes import Field, Fp8Format, Op
from ...protocol.digest import low_latency_combine_digests
from ...protocol.handle import LowLatencyHandle
from ...protocol.handshake import Handshake, show
from ...protocol.low_latency_layout import (add_stats, combine_positions, combine_rows, dispatch_outputs,
                                             dispatch_record_layout, low_latency_unpack, send_order)
from ...transport import Transport
from ...transport.base import Exchange, Gathered, Posted, Rows
from ..base import LowLatencyDispatch, Receive

__all__ = ["LowLatencyMode"]

_COMPARED = (Field.HIDDEN, Field.NUM_EXPERTS, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK)


@dataclass
class _Slot:
    """One of the two low-latency buffers."""

    receive: Optional[Receive] = None
    hook: bool = False  # the receive belongs to the caller's hook
    combine_buffer: Optional[torch.Tensor] = None  # bytes behind get_next_low_latency_combine_buffer


class LowLatencyMode:
    """Low-latency operations of one ``Buffer`` over its transport."""

    #: calls post their rows with their headers and are judged at the receive (else: the handshake
    #: first, and the payload through ``dispatch_exchange`` / ``combine_exchange``, which subclasses
    #: whose payload moves through a vendor's all-to-all override)
    agrees_in_data_path = True

    def __init__(self, transport: Transport, agreement: CallAgreement) -> None:
        self.transport, self.agreement = transport, agreement
        self.rank, self.num_ranks = transport.rank, transport.num_ranks
        self._slots = [_Slot(), _Slot()]
        self._idx = 0
        self._lent: Optional[int] = None  # slot whose combine buffer was lent for a zero-copy combine
        self._unsettled: list[_PostedCall] = []  # posted calls whose headers are not judged yet, in post order
        #: the dispatch outputs of both buffer halves per geometry, for prepared calls (``prepared.py``)
        self.prepared_outputs: dict[tuple, list[tuple]] = {}
        if self.agrees_in_data_path:
            for op in ("low_latency_dispatch", "low_latency_combine"):
                agreement.rejecters[op] = self._reject
        agreement.before_handshake.append(self._settle_all)

    # ------------------------------------------------------------------ double buffering
    def _acquire(self, op: str, zero_copy: bool = False) -> _Slot:
        """The slot this call uses; finishes an un-received async result there, refuses a hooked one."""
        lent, self._lent = self._lent, None
        if zero_copy and lent != self._idx:
            raise RuntimeError(f"{op}: zero_copy=True reads the buffer from get_next_low_latency_combine_buffer(handle), "
                               f"which must be called (and written) right before this combine, with no low-latency "
                               f"call in between (DeepEP would combine overwritten data)")
        slot = self._slots[self._idx]
        self._settle(op, slot)
        return slot

    def _settle(self, op: str, slot: _Slot) -> None:
        if slot.receive is None or slot.receive.done:
            return
        if slot.hook:
            raise RuntimeError(f"{op}: low-latency buffer {self._slots.index(slot)} still holds a result whose "
                               f"recv hook has not been called; at most two low-latency results can be in flight "
                               f"(DeepEP's double buffering), so this call would overwrite it. Call that hook first")
        slot.receive.complete()

    # ------------------------------------------------------------------ masked ranks
    def skip(self) -> frozenset[int]:
        """The ranks this call starts without: the masked ones, plus (with shrink) peers that have
        exited. A shrinking buffer's handshake may mask more (``Handshake.skip``)."""
        masked = self.agreement.masked
        if self.agreement.shrink:
            masked.update(self.transport.exited_ranks())
        return frozenset(masked)

    def _routable(self, topk_idx: torch.Tensor, num_experts: int, skip: frozenset[int]) -> torch.Tensor:
        """``topk_idx`` with the experts of masked ranks replaced by -1."""
        if not skip:
            return topk_idx
        dead = torch.zeros(self.num_ranks, dtype=torch.bool, device=topk_idx.device)
        dead[list(skip)] = True
        owner = topk_idx.clamp(min=0) // (num_experts // self.num_ranks)
        return topk_idx.masked_fill((topk_idx >= 0) & dead[owner], -1)

    def _launch(self, slot: _Slot, op: str, finish: Callable[[], None], hook: bool) -> Receive:
        receive = Receive(op, finish)
        slot.receive, slot.hook = receive, hook
        self._idx ^= 1
        return receive

    # ------------------------------------------------------------------ calls posted with their headers
    def _check_room(self, op: str, record_bytes: int, counts: list[int], m: int, per_token: int) -> None:
        """Rows to one rank must fit where the transport posts them (a rejection, before anything moves):
        ValueError naming the M that fits any routing (``per_token``: the most rows one token makes for one rank)."""
        room = self.transport.post_room(header_bytes(self.agreement.vector_len), record_bytes)
        if room is not None and max(counts, default=0) > room:
            rank = max(range(len(counts)), key=lambda r: counts[r])
            bad_argument(op, "num_max_dispatch_tokens_per_rank", f"at most {room // max(per_token, 1)} here: "
                         f"{counts[rank]} rows of {record_bytes} bytes go to rank {rank}, more than the {room} a data "
                         f"slot of the {self.transport.name} transport holds per rank (its slots of "
                         f"{self.transport.capacity} bytes are sized from num_rdma_bytes when the Buffer is made), and "
                         f"a token makes up to {per_token} rows for one rank; or use transport='collective'", m)

    def _post(self, op: str, header: torch.Tensor, counts: list[int], record_bytes: int, pack: Rows,
              device: torch.device, compare: tuple[Field, ...], hook: bool) -> "_PostedCall":
        # with a hook the rows move while the caller computes; otherwise the receive moves them at once
        posted = self.transport.post(header, counts, record_bytes, pack, op=op, device=device, background=hook)
        call = _PostedCall(self, op, posted, compare, self.agreement.number)
        self._unsettled.append(call)
        return call

    def _reject(self, op: str, number: int, message: str) -> None:
        """Call ``number`` of ``op`` rejected here: a header with the rejected bit goes to every rank,
        so that they fail it alike; nothing is received (the peers' rows of it are dropped unread)."""
        header = self.agreement.rejection_header(Op.of_method(op), number, message)
        posted = self.transport.post(header, [0] * self.num_ranks, 0, no_rows, op=op, device=self.transport.device)
        posted.release()
        self._idx ^= 1  # the peers' calls took a buffer half too
        self._lent = None

    def _settle_all(self) -> None:
        """Settles every posted call in post order (before any other collective of the transport)."""
        while self._unsettled:
            self._unsettled[0].settle(raise_error=False)

    # ------------------------------------------------------------------ payload
    def dispatch_exchange(self, shake: Handshake, record_bytes: int, pack: Rows, device: torch.device) -> Exchange:
        """Starts a dispatch's records on their way (``Transport.exchange`` of ``shake.matrix``; ``pack(dest,
        first, out)`` writes rows ``[first, first + len(out))`` of this rank's send order, destinations
        ascending). Received rows come grouped by source rank ascending."""
        return self.transport.exchange(shake.matrix, record_bytes, pack, op="low_latency_dispatch", device=device,
                                       skip=shake.skip)

    def combine_exchange(self, shake: Handshake, handle: LowLatencyHandle, record_bytes: int, pack: Rows,
                         device: torch.device) -> Exchange:
        """Starts a combine's rows back to their sources (as ``dispatch_exchange``; ``handle``: the dispatch's)."""
        return self.transport.exchange(shake.matrix, record_bytes, pack, op="low_latency_combine", device=device,
                                       skip=shake.skip)

    # ------------------------------------------------------------------ dispatch
    def agree_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int,
                       fp8_format: Fp8Format, skip: frozenset[int]
                       ) -> tuple[Handshake, torch.Tensor, torch.Tensor, int]:
        """A dispatch's handshake: (handshake, msg, experts, ns it waited); ``msg`` and ``experts`` are
        ``send_order`` of the routable top-k (the experts of ``handshake.skip``, the masked ranks, dropped)."""
        routing = {}

        def propose(skip: frozenset[int]) -> dict[str, Any]:
            routing["msg"], routing["experts"], send_counts = send_order(
                self._routable(topk_idx, num_experts, skip), num_experts, self.num_ranks)
            return dict(send_counts=send_counts)

        first = propose(skip)
        start = time.perf_counter_ns()
        fields = {Field.HIDDEN: x.shape[1], Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m,
                  Field.FP8_FORMAT: fp8_format}
        shake = self.agreement.handshake("low_latency_dispatch", Op.LOW_LATENCY_DISPATCH, fields, first["send_counts"],
                                         None, _COMPARED + (Field.FP8_FORMAT,), self.transport.device, skip,
                                         propose=propose)
        return shake, routing["msg"], routing["experts"], time.perf_counter_ns() - start

    def _dispatch_records(self, x: torch.Tensor, fp8_format: Fp8Format, msg: torch.Tensor, experts: torch.Tensor,
                          num_topk: int, local: int) -> tuple[RecordLayout, Rows, Optional[torch.Tensor]]:
        """A dispatch's records (x cast to ``fp8_format``, scales, source token, local expert), what packs
        them in send order (``msg``, ``experts``: ``send_order``), and the scales (None in bf16)."""
        scales, data = None, x
        if fp8_format is not Fp8Format.BF16:
            data, scales = quantize(x, "e4m3", round_scale=fp8_format.round_scale, use_ue8m0=fp8_format.ue8m0)
            data = data.view(torch.uint8)
        records = dispatch_record_layout(x.shape[1], fp8_format)
        src_index = torch.arange(x.shape[0], dtype=torch.int32, device=x.device).unsqueeze(1)
        fields = [data] + ([] if scales is None else [scales]) + [src_index, None]
        tokens, local_expert = msg // max(num_topk, 1), (experts % local).to(torch.int32).unsqueeze(1)
        if x.device.type == "cpu":  # rows a transport may write natively
            return records, Gathered(native_segments(records, fields, "low_latency_dispatch"), fields, tokens,
                                     records.record_bytes, local_expert[:, 0], records.field("expert").offset), scales

        def pack(dest: int, first: int, out: torch.Tensor) -> None:
            part = slice(first, first + out.shape[0])
            pack_rows(records, fields, tokens[part], out=out)
            records.view(out, "expert").copy_(local_expert[part])

        return records, pack, scales

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int, fp8_format: Fp8Format,
                 recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 hook: bool) -> LowLatencyDispatch:
        """Checked ``low_latency_dispatch`` (see ``Buffer``); returns outputs filled by ``receive``. The
        rows and this call's header leave at once (``Transport.post``); the receive judges every rank's
        header before it reads a row."""
        if self.agreement.shrink or not self.agrees_in_data_path:
            return self._handshake_dispatch(x, topk_idx, m, num_experts, fp8_format, recv_stats, wait_stats, hook)
        op = "low_latency_dispatch"
        R, device, hidden = self.num_ranks, x.device, x.shape[1]
        local = num_experts // R
        slot = self._acquire(op)
        msg, experts, send_counts = send_order(topk_idx, num_experts, R)
        records, pack, scales = self._dispatch_records(x, fp8_format, msg, experts, topk_idx.shape[1], local)
        self._check_room(op, records.record_bytes, send_counts, m, min(topk_idx.shape[1], local))
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m,
                  Field.FP8_FORMAT: fp8_format}
        header = self.agreement.header(Op.LOW_LATENCY_DISPATCH, fields, send_counts)
        call = self._post(op, header, send_counts, records.record_bytes, pack, device,
                          _COMPARED + (Field.FP8_FORMAT,), hook)

        def take() -> tuple[torch.Tensor, list[int], Optional[list[int]]]:
            counts = call.settle()
            received, firsts = call.rows()
            return received, counts, firsts

        return self._dispatch_result(op, slot, hook, records, scales, m, num_experts, x, take, call.release,
                                     recv_stats, wait_stats, 0)

    def _dispatch_result(self, op: str, slot: _Slot, hook: bool, records: RecordLayout,
                         scales: Optional[torch.Tensor], m: int, num_experts: int, x: torch.Tensor,
                         take: Callable[[], tuple[torch.Tensor, list[int], Optional[list[int]]]],
                         release: Callable[[], None], recv_stats: Optional[torch.Tensor],
                         wait_stats: Optional[torch.Tensor], waited: int) -> LowLatencyDispatch:
        """A dispatch's outputs and the receive that fills them: ``take()`` waits for the rows (records,
        rows from each source, where each source's start or None when packed), ``release()`` hands them
        back; ``waited``: ns already spent waiting (a handshake's)."""
        hidden, device = x.shape[1], x.device
        recv_x, recv_scales, src_info, layout_range, recv_count = dispatch_outputs(
            num_experts // self.num_ranks, self.num_ranks, m, hidden,
            None if scales is None else (scales.dtype, scales.shape[1]), device)

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            try:
                received, recv_counts, firsts = take()
                low_latency_unpack(records, received, recv_counts, recv_x, recv_scales, src_info, layout_range,
                                   recv_count, firsts)
            finally:
                release()
            add_stats(recv_stats, recv_count, wait_stats, waited + time.perf_counter_ns() - begin)

        receive = self._launch(slot, op, finish, hook)
        handle = LowLatencyHandle(src_info, layout_range, m, hidden, num_experts)
        return LowLatencyDispatch(recv_x, recv_scales, recv_count, handle, receive)

    def _handshake_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int,
                            fp8_format: Fp8Format, recv_stats: Optional[torch.Tensor],
                            wait_stats: Optional[torch.Tensor], hook: bool) -> LowLatencyDispatch:
        """``dispatch`` with the handshake first (a shrinking buffer masks late ranks there), then the rows."""
        op = "low_latency_dispatch"
        R, device = self.num_ranks, x.device
        local = num_experts // R
        slot = self._acquire(op)
        shake, msg, experts, waited = self.agree_dispatch(x, topk_idx, m, num_experts, fp8_format, self.skip())
        recv_counts = shake.recv_counts(self.rank)
        records, pack, scales = self._dispatch_records(x, fp8_format, msg, experts, topk_idx.shape[1], local)
        exchange = self.dispatch_exchange(shake, records.record_bytes, pack, device)
        return self._dispatch_result(op, slot, hook, records, scales, m, num_experts, x,
                                     lambda: (exchange.wait(), recv_counts, None), exchange.release, recv_stats,
                                     wait_stats, waited)

    # ------------------------------------------------------------------ combine
    def next_combine_buffer(self, handle: LowLatencyHandle, device: torch.device) -> torch.Tensor:
        """The bf16 `[E_loc, R * M, H]` buffer the next (zero-copy) combine reads."""
        local = handle.num_experts // self.num_ranks
        shape = (local, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        nbytes = 2 * shape[0] * shape[1] * shape[2]
        slot = self._slots[self._idx]
        if slot.combine_buffer is None or slot.combine_buffer.numel() < nbytes or slot.combine_buffer.device != device:
            slot.combine_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._lent = self._idx
        return slot.combine_buffer[:nbytes].view(torch.bfloat16).view(shape)

    def agree_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, handle: LowLatencyHandle, skip: frozenset[int],
                      use_logfmt: bool = False) -> tuple[Handshake, torch.Tensor, LowLatencyHandle, int]:
        """A combine's handshake: (handshake, msg, the handle with the ranges of ``handshake.skip``, the
        masked sources, emptied, ns it waited); ``msg`` is ``send_order`` of the routable top-k."""
        R, num_experts = self.num_ranks, handle.num_experts
        given, state = handle, {}

        def propose(skip: frozenset[int]) -> dict[str, Any]:
            msg, experts, expected = send_order(self._routable(topk_idx, num_experts, skip), num_experts, R)
            handle = given
            if skip:  # nothing goes back to masked sources
                layout_range = handle.layout_range.clone()
                layout_range[:, list(skip)] = 0
                handle = dataclasses.replace(handle, layout_range=layout_range)
            state["msg"], state["handle"] = msg, handle
            # which (local expert, token) each returned row answers, as both sides see it
            returned, asked = low_latency_combine_digests(handle.layout_range, handle.src_info, msg, experts,
                                                          expected, topk_idx.shape[1])
            return dict(send_counts=handle.counts().sum(0).tolist(),  # rows going back to each source rank
                        expected=expected, sent_digests=returned, expected_digests=asked)

        first = propose(skip)
        start = time.perf_counter_ns()
        fields = {Field.HIDDEN: x.shape[2], Field.NUM_EXPERTS: num_experts,
                  Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: handle.num_max_dispatch_tokens_per_rank,
                  Field.USE_LOGFMT: int(use_logfmt)}
        shake = self.agreement.handshake("low_latency_combine", Op.LOW_LATENCY_COMBINE, fields, first["send_counts"],
                                         first["expected"], _COMPARED + (Field.USE_LOGFMT,), self.transport.device,
                                         skip, sent_digests=first["sent_digests"],
                                         expected_digests=first["expected_digests"], propose=propose)
        return shake, state["msg"], state["handle"], time.perf_counter_ns() - start

    def _combine_records(self, slot: _Slot, x: torch.Tensor, zero_copy: bool, send_rows: torch.Tensor,
                         use_logfmt: bool) -> tuple[RecordLayout, Rows]:
        """A combine's records (bf16 rows, or LogFMT-10) and what packs rows ``send_rows`` of x (or of the
        lent zero-copy buffer) in send order."""
        local, rows, hidden = x.shape
        source = slot.combine_buffer[:x.numel() * 2].view(torch.bfloat16).view(x.shape) if zero_copy else x
        source = [source.reshape(local * rows, hidden)]
        if use_logfmt:
            records = RecordLayout.build([("x", torch.uint8, logfmt_row_bytes(hidden))])

            def encode(dest: int, first: int, out: torch.Tensor) -> None:
                logfmt_encode(source[0][send_rows[first:first + out.shape[0]]], out=records.view(out, "x"))
            return records, encode
        records = RecordLayout.build([("x", torch.bfloat16, hidden)])
        if x.device.type == "cpu":  # rows a transport may write natively
            return records, Gathered(native_segments(records, source, "low_latency_combine"), source, send_rows,
                                     records.record_bytes)

        def pack(dest: int, first: int, out: torch.Tensor) -> None:
            pack_rows(records, source, send_rows[first:first + out.shape[0]], out=out)
        return records, pack

    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                zero_copy: bool, out: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                hook: bool, use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        """Checked ``low_latency_combine`` (see ``Buffer``); returns (out, receive that fills it). With
        ``use_logfmt`` each row travels LogFMT-encoded (``ops.logfmt``) and is decoded in the reduction.
        The rows and the header (with the digests of the handle's routing) leave at once, as in ``dispatch``."""
        if self.agreement.shrink or not self.agrees_in_data_path:
            return self._handshake_combine(x, topk_idx, topk_weights, handle, zero_copy, out, wait_stats, hook,
                                           use_logfmt)
        op = "low_latency_combine"
        R, device = self.num_ranks, x.device
        local, rows, hidden = x.shape
        slot = self._acquire(op, zero_copy)
        msg, experts, expected = send_order(topk_idx, handle.num_experts, R)
        returned, asked = low_latency_combine_digests(handle.layout_range, handle.src_info, msg, experts, expected,
                                                      topk_idx.shape[1])
        send_counts = handle.counts().sum(0).tolist()  # rows going back to each source rank
        send_rows = combine_rows(handle.layout_range, rows)  # by source rank, then local expert, then row
        records, pack = self._combine_records(slot, x, zero_copy, send_rows, use_logfmt)
        self._check_room(op, records.record_bytes, send_counts, handle.num_max_dispatch_tokens_per_rank,
                         min(topk_idx.shape[1], local))
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: handle.num_experts,
                  Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: handle.num_max_dispatch_tokens_per_rank,
                  Field.USE_LOGFMT: int(use_logfmt)}
        header = self.agreement.header(Op.LOW_LATENCY_COMBINE, fields, send_counts, expected, returned, asked)
        call = self._post(op, header, send_counts, records.record_bytes, pack, device,
                          _COMPARED + (Field.USE_LOGFMT,), hook)
        num_tokens, num_topk = topk_idx.shape
        if out is None:
            out = empty((num_tokens, hidden), torch.bfloat16, device)

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            try:
                call.settle()
                received, firsts = call.rows()
                pos = combine_positions(msg, experts, num_tokens * num_topk, local, R, firsts)
                combine_reduce(records, received, pos.view(num_tokens, num_topk), None, None, out, None,
                               scale=topk_weights, x_format="logfmt" if use_logfmt else "plain")
            finally:
                call.release()
            add_stats(None, None, wait_stats, time.perf_counter_ns() - begin)

        return out, self._launch(slot, op, finish, hook)

    def _handshake_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           handle: LowLatencyHandle, zero_copy: bool, out: Optional[torch.Tensor],
                           wait_stats: Optional[torch.Tensor], hook: bool,
                           use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        """``combine`` with the handshake first (a shrinking buffer masks late ranks there), then the rows."""
        op = "low_latency_combine"
        device = x.device
        slot = self._acquire(op, zero_copy)
        shake, msg, handle, waited = self.agree_combine(x, topk_idx, handle, self.skip(), use_logfmt)
        send_rows = combine_rows(handle.layout_range, x.shape[1])  # by source rank, then local expert, then row
        records, pack = self._combine_records(slot, x, zero_copy, send_rows, use_logfmt)
        exchange = self.combine_exchange(shake, handle, records.record_bytes, pack, device)

        num_tokens, num_topk = topk_idx.shape
        pos = torch.full((num_tokens * num_topk,), -1, dtype=torch.int32, device=device)
        pos[msg] = torch.arange(msg.shape[0], dtype=torch.int32, device=device)
        pos = pos.view(num_tokens, num_topk)
        if out is None:
            out = empty((num_tokens, x.shape[2]), torch.bfloat16, device)

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            try:
                combine_reduce(records, exchange.wait(), pos, None, None, out, None, scale=topk_weights,
                               x_format="logfmt" if use_logfmt else "plain")
            finally:
                exchange.release()
            add_stats(None, None, wait_stats, waited + time.perf_counter_ns() - begin)

        return out, self._launch(slot, op, finish, hook)

    # ------------------------------------------------------------------ clean
    def clean(self, m: int, hidden: int, num_experts: int, device: torch.device) -> None:
        """DeepEP's ``clean_low_latency_buffer``: finishes async results, refuses un-received hooked
        ones, forgets a lent combine buffer, and meets every rank (a barrier with the deadline)."""
        op = "clean_low_latency_buffer"
        for slot in self._slots:
            self._settle(op, slot)
        self._lent = None
        zeros = [0] * self.num_ranks
        fields = {Field.HIDDEN: hidden, Field.NUM_EXPERTS: num_experts, Field.NUM_MAX_DISPATCH_TOKENS_PER_RANK: m}
        self.agreement.handshake(op, Op.CLEAN_LOW_LATENCY_BUFFER, fields, zeros, zeros, _COMPARED, device, self.skip())


class _PostedCall:
    """One low-latency call's receive side: its headers judged, then its rows, once, in post order."""

    def __init__(self, mode: LowLatencyMode, op: str, posted: Posted, compare: tuple[Field, ...], number: int) -> None:
        self._mode, self._op, self._posted, self._compare, self._number = mode, op, posted, compare, number
        self._result: Optional[list[int]] = None
        self._error: Optional[BaseException] = None

    def settle(self, raise_error: bool = True) -> Optional[list[int]]:
        """The rows each rank sent this one, once the headers agree (None after a failure that is not raised);
        the calls posted before it settle first. A failure is kept and raised here and at every later settle;
        one that is not an agreed verdict breaks the buffer."""
        pending = self._mode._unsettled
        while self in pending:
            first = pending.pop(0)
            first._run()
        if self._error is not None and raise_error:
            raise self._error
        return self._result

    def rows(self) -> tuple[torch.Tensor, list[int]]:
        """(rows, where each source's rows start) of a settled call, where they are now: taken only when they
        are consumed, as a post the transport moved out of a slot it reused (``Posted``'s spill) has its rows
        elsewhere than when it was settled."""
        return self._posted.rows()

    def _run(self) -> None:
        try:
            self._result = self._mode.agreement.receive_counts(self._op, self._headers(), self._compare)
            # the rows move now, in post order (a transport's thread may still move an earlier call's on the same
            # channel); ``rows`` takes them where they are when they are consumed
            self._posted.rows()
        except BaseException as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """The receive failed with ``exc``: kept for ``settle``, the rows dropped, and the buffer broken unless
        every rank reached that verdict alike; an interrupt goes on up."""
        agreement = self._mode.agreement
        self._error = exc
        self.release()
        if not is_agreed(exc):
            agreement.breaks(f"{type(exc).__name__} while receiving {self._op} (call {self._number}) on rank "
                             f"{agreement.rank}: {exc}")
        if not isinstance(exc, Exception):
            raise

    def _headers(self) -> torch.Tensor:
        try:
            return self._posted.headers()
        except CommTimeoutError as exc:
            heard = []
            for rank in exc.missing_ranks or []:
                last = self._posted.last_call_header(rank)
                if last is None:  # the transport keeps no header
                    continue
                if not last.numel():
                    heard.append(f"rank {rank} has sent no call here yet")
                else:
                    row = decode(last.reshape(1, -1), len(Field))[0]
                    heard.append(f"rank {rank} last sent call {row[Field.CALL]} ({show(Field.OP, row[Field.OP])})")
            if not heard:
                raise
            detail = f"this rank waits for call {self._number} ({self._op}); " + "; ".join(heard)
            raise CommTimeoutError(exc.op, exc.rank, exc.timeout_s, exc.missing_ranks,
                                   detail + (f"; {exc.detail}" if exc.detail else "")) from exc

    def release(self) -> None:
        self._posted.release()
