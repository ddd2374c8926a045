"""Low-latency mode on MC2: the portable mode's call agreement and double buffering, with the tokens
moved by ``npu_moe_distribute_dispatch(_v2)`` / ``_combine(_v2)`` and converted to DeepEP's layouts.

    dispatch:  checks (MC2's limits, HCCL_BUFFSIZE) -> handshake
               -> routing records (source token, local expert; 8 B each) through the transport
               -> MC2 dispatch of x padded to M rows   ...   receive: src_info / layout_range /
               recv_count from the records, expert_token_nums checked against them, expand_x's
               expert-grouped rows copied to [E_loc, R * M, H]
    combine:   handshake -> [E_loc, R * M, H] rows copied back to expand_x's grouping -> MC2 combine
               (weighted sum per token)   ...   receive: out = its first T rows

MC2's outputs name no source rank or token (its bookkeeping is opaque), so the routing records give
DeepEP's handle. Inside a local expert, the rows are taken to arrive by source rank, then token (the
portable order); MC2's documentation does not state an order, so the receive checks every expert's
count against the records, and ``pytest -m ascend`` compares the rows with the portable backend's on
an NPU. ``use_fp8`` maps to MC2's dynamic INT8 quantisation (A2/A3 have no FP8): ``recv_x`` is int8
with one fp32 scale per row (``recv_scales`` `[E_loc, R * M, 1]`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from ...core.memory import empty, zeros
from ...ops.records import RecordLayout, pack_rows
from ...protocol.agreement import CallAgreement
from ...protocol.codes import Fp8Format
from ...protocol.handle import LowLatencyHandle
from ...protocol.low_latency_layout import add_stats, low_latency_unpack
from ...transport import Transport
from ..base import LowLatencyDispatch, Receive
from ..portable.low_latency import LowLatencyMode
from ..vendor_common.expert_rows import copy_expert_rows
from ..vendor_common.per_handle import PerHandle
from .mc2 import Mc2, Mc2Routing

__all__ = ["Mc2LowLatencyMode"]

# what travels beside MC2's payload: each row's source token and local expert (no x: MC2 moves it)
_ROUTING = RecordLayout.build([("x", torch.uint8, 0), ("src", torch.int32, 1), ("expert", torch.int32, 1)])


class Mc2LowLatencyMode(LowLatencyMode):
    """``LowLatencyMode`` whose payload moves through MC2."""

    agrees_in_data_path = False  # the vendor's all-to-all needs every rank's counts first: handshake first

    def __init__(self, transport: Transport, agreement: CallAgreement, mc2: Mc2) -> None:
        super().__init__(transport, agreement)
        self.mc2 = mc2
        self._routings: PerHandle[Mc2Routing] = PerHandle()  # each dispatch's MC2 routing

    def _padded(self, topk_idx: torch.Tensor, num_experts: int, skip: frozenset[int], m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [M, K] int32, active [M, K] bool): the routable entries of ``topk_idx`` active, every
        other entry (-1, a masked rank's expert, padding) inactive and naming expert 0."""
        routable = self._routable(topk_idx, num_experts, skip)
        ids = torch.zeros(m, topk_idx.shape[1], dtype=torch.int32, device=topk_idx.device)
        active = torch.zeros(m, topk_idx.shape[1], dtype=torch.bool, device=topk_idx.device)
        ids[:topk_idx.shape[0]] = routable.clamp(min=0).to(torch.int32)
        active[:topk_idx.shape[0]] = routable >= 0
        return ids, active

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int, fp8_format: Fp8Format,
                 recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 hook: bool) -> LowLatencyDispatch:
        op = "low_latency_dispatch"
        if fp8_format.round_scale:
            raise ValueError(f"{op}: the ascend backend quantises with MC2's dynamic INT8 (one fp32 scale per token; "
                             f"Atlas A2/A3 have no FP8), which has no power-of-two scales: round_scale and use_ue8m0 "
                             f"must be False, got {fp8_format.label}")
        quant = fp8_format is not Fp8Format.BF16
        R, device, hidden = self.num_ranks, x.device, x.shape[1]
        local, rows = num_experts // R, R * m
        self.mc2.check(op, num_experts, hidden, m, topk_idx.shape[1], quant)
        slot = self._acquire(op)
        shake, msg, experts, waited = self.agree_dispatch(x, topk_idx, m, num_experts, fp8_format, self.skip())
        tokens, local_expert = msg // max(topk_idx.shape[1], 1), (experts % local).to(torch.int32).unsqueeze(1)
        src_index = torch.arange(x.shape[0], dtype=torch.int32, device=device).unsqueeze(1)

        def pack(dest: int, first: int, out: torch.Tensor) -> None:
            part = slice(first, first + out.shape[0])
            pack_rows(_ROUTING, [x[:, :0].view(torch.uint8), src_index, None], tokens[part], out=out)
            _ROUTING.view(out, "expert").copy_(local_expert[part])

        exchange = self.dispatch_exchange(shake, _ROUTING.record_bytes, pack, device)
        padded = zeros((m, hidden), torch.bfloat16, device)
        padded[:x.shape[0]] = x
        ids, active = self._padded(topk_idx, num_experts, shake.skip, m)
        expand_x, expand_scales, routing = self.mc2.dispatch(padded, ids, active, num_experts, quant)

        recv_x = zeros((local, rows, hidden), torch.int8 if quant else torch.bfloat16, device)
        recv_scales = zeros((local, 1, rows), torch.float32, device).transpose(1, 2) if quant else None
        src_info = torch.full((local, rows), -1, dtype=torch.int32, device=device)
        layout_range = torch.empty(local, R, dtype=torch.int64, device=device)
        recv_count = torch.empty(local, dtype=torch.int32, device=device)
        recv_counts = shake.recv_counts(self.rank)

        @self.agreement.deferred(op)
        def finish() -> None:
            begin = time.perf_counter_ns()
            try:
                low_latency_unpack(_ROUTING, exchange.wait(), recv_counts, recv_x[:, :, :0].view(torch.uint8), None,
                                   src_info, layout_range, recv_count)
            finally:
                exchange.release()
            if routing.counts != recv_count.tolist():
                raise RuntimeError(f"{op}: MC2's expert_token_nums {routing.counts} differ from the rows the routing "
                                   f"sends each local expert {recv_count.tolist()} (rank {self.rank}): this NPU's "
                                   f"MC2 does not keep the documented contract the ascend backend relies on")
            copy_expert_rows(True, recv_x, expand_x, routing.counts)
            if recv_scales is not None:
                copy_expert_rows(True, recv_scales.transpose(1, 2).view(local, rows, 1), expand_scales.unsqueeze(1),
                           routing.counts)
            add_stats(recv_stats, recv_count, wait_stats, waited + time.perf_counter_ns() - begin)

        receive = self._launch(slot, op, finish, hook)
        handle = LowLatencyHandle(src_info, layout_range, m, hidden, num_experts)
        self._routings.remember(handle, routing)
        return LowLatencyDispatch(recv_x, recv_scales, recv_count, handle, receive)

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: LowLatencyHandle,
                zero_copy: bool, out: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                hook: bool, use_logfmt: bool = False) -> tuple[torch.Tensor, Receive]:
        op = "low_latency_combine"
        if use_logfmt:
            raise ValueError(f"{op}: use_logfmt must be False on the ascend backend: MC2's combine moves bf16 rows "
                             f"(its own wire quantisation is comm_quant_mode, not LogFMT)")
        routing = self._routings.get(op, handle, "the ascend backend's combine needs that dispatch's MC2 bookkeeping")
        slot = self._acquire(op, zero_copy)
        shake, _, _, waited = self.agree_combine(x, topk_idx, handle, self.skip())
        source = slot.combine_buffer[:x.numel() * 2].view(torch.bfloat16).view(x.shape) if zero_copy else x
        expand_x = zeros((routing.recv_rows, x.shape[2]), torch.bfloat16, x.device)
        copy_expert_rows(False, source.contiguous(), expand_x, routing.counts)
        m, num_tokens = routing.expert_ids.shape[0], topk_idx.shape[0]
        weights = zeros((m, topk_idx.shape[1]), torch.float32, x.device)
        weights[:num_tokens] = topk_weights
        # experts of ranks masked since the dispatch contribute nothing, as on the portable backend
        _, still = self._padded(topk_idx, handle.num_experts, shake.skip, m)
        combined = self.mc2.combine(expand_x, weights, dataclasses.replace(routing, active=routing.active & still),
                                    handle.num_experts)
        if out is None:
            out = empty((num_tokens, x.shape[2]), torch.bfloat16, x.device)

        @self.agreement.deferred(op)
        def finish() -> None:
            out.copy_(combined[:num_tokens])
            add_stats(None, None, wait_stats, waited)

        return out, self._launch(slot, op, finish, hook)

