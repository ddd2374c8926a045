"""``torch_mlu_ops``' expert-parallel all-to-all (``moe_all2all_*``) as the cambricon backend drives it:
a byte all-to-all of row records, whose calling conventions come from its public callers (vllm-mlu's
``CnclEP``, xllm; ``docs/vendors.md``).

    create(dispatch bytes, combine bytes, experts, rows) -> every rank's exchange_info all-gathered
    -> init;   dispatch: rows sorted by destination rank in dispatch_send, (offset, count) per
    destination -> rows from source r land at r * rows_cap in dispatch_recv, recv_layout / recv_token_num
    say where they came from;   combine: rows back in the compact by-source order, to the offsets the
    dispatch's recv_layout names -> combine_recv holds them in the dispatch's send order.

The handle is sized by what the ranks agreed in the call's handshake (the largest rows any rank
sends), so every rank makes the same decision to (re)create it, and it grows by doubling.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch

from ...transport import Transport
from ..vendor_common.expert_rows import copy_expert_rows

__all__ = ["TmoAll2All", "send_layout"]


def send_layout(counts: list[int], device: torch.device) -> torch.Tensor:
    """``[R, 2]`` int32 (offset, count) per rank of rows laid out by rank ascending
    (``moe_all2all_gen_send_layout`` of per-rank totals)."""
    offsets = [sum(counts[:r]) for r in range(len(counts))]
    return torch.tensor(list(zip(offsets, counts)), dtype=torch.int32, device=device).view(len(counts), 2)


class TmoAll2All:
    """One Buffer's tmo all-to-all handle and its buffers (``dispatch_send`` ... ``combine_recv``)."""

    def __init__(self, tmo: ModuleType, transport: Transport) -> None:
        self.tmo, self.transport = tmo, transport
        self.rank, self.num_ranks = transport.rank, transport.num_ranks
        self.handle: Optional[int] = None
        self.dispatch_bytes = self.combine_bytes = self.num_experts = self.rows = 0
        self.buffers: tuple[torch.Tensor, ...] = ()

    def ensure(self, dispatch_bytes: int, combine_bytes: int, num_experts: int, rows: int, op: str) -> None:
        """A handle for rows of these sizes, ``rows`` rows per rank at most. Collective when it (re)creates
        one; the arguments must be the same on every rank (they come from the call's handshake)."""
        if (self.handle is not None and dispatch_bytes <= self.dispatch_bytes and combine_bytes <= self.combine_bytes
                and num_experts == self.num_experts and rows <= self.rows):
            return
        self.destroy()
        dispatch_bytes, combine_bytes = max(dispatch_bytes, self.dispatch_bytes), max(combine_bytes, self.combine_bytes)
        rows = max(rows, 2 * self.rows if num_experts == self.num_experts else 0, 1)
        handle, info_size, info, *buffers = self.tmo.moe_all2all_create(dispatch_bytes, combine_bytes, num_experts,
                                                                        rows, self.rank, self.num_ranks)
        # every rank's exchange info, gathered through the Buffer's transport (on its device), back on the CPU
        gathered = self.transport.all_gather_rows(info.reshape(-1)[:info_size].to(self.transport.device), op=op)
        self.tmo.moe_all2all_init(handle, gathered.cpu())
        self.transport.all_gather_rows(torch.zeros(1, dtype=torch.int32, device=self.transport.device), op=op)
        self.handle, self.buffers = handle, tuple(buffers)
        self.dispatch_bytes, self.combine_bytes, self.num_experts, self.rows = dispatch_bytes, combine_bytes, \
            num_experts, rows

    def _pack(self, send: torch.Tensor, counts: list[int], record_bytes: int,
              pack: Callable[[int, int, torch.Tensor], None]) -> int:
        """``pack(r, first, out)`` writes the ``counts[r]`` records for each rank r, ranks ascending, straight
        into the send buffer ``send``; returns the records written."""
        rows = send.view(torch.uint8)[:self.rows * record_bytes].view(self.rows, record_bytes)
        first = 0
        for rank, n in enumerate(counts):
            pack(rank, first, rows[first:first + n])
            first += n
        return first

    def dispatch(self, sent: list[int], record_bytes: int, per_expert: torch.Tensor,
                 pack: Callable[[int, int, torch.Tensor], None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sends ``sent[d]`` records of ``record_bytes`` to each rank d, which ``pack(d, first, out)`` writes
        straight into ``dispatch_send``; ``per_expert`` [E] int32: the records for each global expert.
        Returns (received records grouped by source rank ascending, recv_layout [R, 2], recv_token_num [E])."""
        send, recv = self.buffers[0], self.buffers[1]
        first = self._pack(send, sent, record_bytes, pack)
        recv_layout = torch.empty(self.num_ranks, 2, dtype=torch.int32, device=send.device)
        recv_token_num = torch.empty(per_expert.shape[0], dtype=torch.int32, device=send.device)
        self.tmo.moe_all2all_dispatch(self.handle, record_bytes, first, send_layout(sent, send.device), per_expert,
                                      recv_layout, recv_token_num)
        got = recv.view(torch.uint8)[:self.num_ranks * self.rows * record_bytes].view(self.num_ranks, self.rows,
                                                                                    record_bytes)
        counts = recv_layout[:, 1].tolist()
        records = torch.empty(sum(counts), record_bytes, dtype=torch.uint8, device=got.device)
        copy_expert_rows(False, got, records, counts)  # bounds-checked: counts past the padding are refused
        return records, recv_layout, recv_token_num

    def combine(self, returned: list[int], expected: int, record_bytes: int, recv_layout: torch.Tensor,
                pack: Callable[[int, int, torch.Tensor], None]) -> torch.Tensor:
        """Sends ``returned[s]`` records back to each source s (``pack`` as in ``dispatch``) to the places
        the dispatch's ``recv_layout`` names; returns the ``expected`` records that come back, in the
        order this rank dispatched them."""
        send, recv = self.buffers[2], self.buffers[3]
        self._pack(send, returned, record_bytes, pack)
        self.tmo.moe_all2all_combine(self.handle, record_bytes, expected, send_layout(returned, send.device),
                                     recv_layout)
        # a copy: the next combine reuses combine_recv while this one's receive may still wait for its hook
        return recv.view(torch.uint8)[:expected * record_bytes].view(expected, record_bytes).clone()

    def destroy(self) -> None:
        """Releases the handle (idempotent)."""
        if self.handle is not None:
            handle, self.handle, self.buffers = self.handle, None, ()
            self.tmo.moe_all2all_destroy(handle)
