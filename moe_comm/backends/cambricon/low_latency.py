"""Low-latency mode on ``torch_mlu_ops``' all-to-all: the portable mode, its records moved by
``moe_all2all_dispatch`` / ``_combine`` (``tmo.py``) instead of the transport. The records, their
packing, the receive's unpacking and the combine's reduction are the portable backend's, so the
outputs are its outputs bit for bit; the handshake's counts size the all-to-all's handle and are
checked against what it reports having received."""
from __future__ import annotations

from typing import Optional

import torch

from ...ops.logfmt import logfmt_row_bytes
from ...ops.records import RecordLayout
from ...protocol.agreement import CallAgreement
from ...protocol.codes import Fp8Format
from ...protocol.handle import LowLatencyHandle
from ...protocol.handshake import Handshake
from ...transport import Transport
from ...transport.base import Exchange, Rows
from ..base import LowLatencyDispatch
from ..portable.low_latency import LowLatencyMode
from ..vendor_common.per_handle import PerHandle
from .tmo import TmoAll2All

__all__ = ["TmoLowLatencyMode"]


class _Received:
    """An ``Exchange`` whose rows have already arrived (tmo's calls return when they are in place)."""

    def __init__(self, records: torch.Tensor) -> None:
        self.records = records

    def wait(self) -> torch.Tensor:
        return self.records

    def release(self) -> None:
        pass


class TmoLowLatencyMode(LowLatencyMode):
    """``LowLatencyMode`` whose payload moves through ``moe_all2all``."""

    agrees_in_data_path = False  # the vendor's all-to-all needs every rank's counts first: handshake first

    def __init__(self, transport: Transport, agreement: CallAgreement, all2all: TmoAll2All) -> None:
        super().__init__(transport, agreement)
        self.all2all = all2all
        self._layouts: PerHandle[torch.Tensor] = PerHandle()  # each dispatch's recv_layout
        # the dispatch in progress: its (num_experts, hidden, records per global expert) from its handshake,
        # then the recv_layout it got
        self._call: Optional[tuple[int, int, torch.Tensor]] = None
        self._layout: Optional[torch.Tensor] = None

    def _rows(self, shake: Handshake) -> int:
        """The most rows any rank sends or receives in this call (the same on every rank)."""
        sends = [sum(row) for row in shake.matrix]
        receives = [sum(column) for column in zip(*shake.matrix)]
        return max(sends + receives)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int, fp8_format: Fp8Format,
                 recv_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 hook: bool) -> LowLatencyDispatch:
        try:
            result = super().dispatch(x, topk_idx, m, num_experts, fp8_format, recv_stats, wait_stats, hook)
            self._layouts.remember(result.handle, self._layout)
        finally:
            self._call = self._layout = None
        return result

    def agree_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, m: int, num_experts: int,
                       fp8_format: Fp8Format, skip: frozenset[int]
                       ) -> tuple[Handshake, torch.Tensor, torch.Tensor, int]:
        """The portable handshake; keeps what the all-to-all needs of it (its send order's experts counted)."""
        shake, msg, experts, waited = super().agree_dispatch(x, topk_idx, m, num_experts, fp8_format, skip)
        per_expert = torch.bincount(experts, minlength=num_experts).to(torch.int32)
        self._call = (num_experts, x.shape[1], per_expert)
        return shake, msg, experts, waited

    def dispatch_exchange(self, shake: Handshake, record_bytes: int, pack: Rows, device: torch.device) -> Exchange:
        num_experts, hidden, per_expert = self._call
        # the combine's rows: bf16, or LogFMT-10 (sized here so a combine need not grow the handle)
        combine_bytes = max(RecordLayout.build([("x", torch.bfloat16, hidden)]).record_bytes,
                            RecordLayout.build([("x", torch.uint8, logfmt_row_bytes(hidden))]).record_bytes)
        self.all2all.ensure(record_bytes, combine_bytes, num_experts, self._rows(shake), "low_latency_dispatch")
        records, layout, _ = self.all2all.dispatch(list(shake.matrix[self.rank]), record_bytes, per_expert.to(device),
                                                   pack)
        got = layout[:, 1].tolist()
        want = shake.recv_counts(self.rank)
        if got != list(want):
            raise RuntimeError(f"low_latency_dispatch: moe_all2all_dispatch delivered {got} rows from each source "
                               f"rank, the handshake agreed on {list(want)} (rank {self.rank}): torch_mlu_ops does "
                               f"not keep the calling convention the cambricon backend relies on")
        self._layout = layout
        return _Received(records)

    def combine_exchange(self, shake: Handshake, handle: LowLatencyHandle, record_bytes: int, pack: Rows,
                         device: torch.device) -> Exchange:
        op = "low_latency_combine"
        layout = self._layouts.get(op, handle, "the cambricon backend's combine sends rows back to the places that "
                                               "dispatch's moe_all2all_dispatch reported")
        self.all2all.ensure(self.all2all.dispatch_bytes, record_bytes, handle.num_experts, self._rows(shake), op)
        returned = list(shake.matrix[self.rank])
        expected = sum(row[self.rank] for row in shake.matrix)
        return _Received(self.all2all.combine(returned, expected, record_bytes, layout, pack))
