"""Where low-latency messages go: the send order of one (token, expert) message each, the rows a
combine returns, and the receive that places each record in its expert's fixed block."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._native import cpu_threads, native
from .records import RecordLayout, unpack_rows

__all__ = ["send_order", "send_order_reference", "combine_rows", "combine_rows_reference", "low_latency_unpack",
           "low_latency_unpack_reference"]


def send_order(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The messages of ``topk_idx`` `[T, K]` int64 (-1 = none) in send order: by expert id (so by
    destination rank, then local expert), then token. Returns (``t * K + k`` `[S]` int64, expert
    `[S]` int64, messages per destination rank). Reference: ``send_order_reference``."""
    if topk_idx.device.type != "cpu":
        return send_order_reference(topk_idx, num_experts, num_ranks)
    topk_idx = topk_idx.contiguous()
    msg = torch.empty(topk_idx.numel(), dtype=torch.int64)
    experts = torch.empty_like(msg)
    counts = torch.empty(num_ranks, dtype=torch.int64)
    n = native().low_latency_send_order(msg.data_ptr(), experts.data_ptr(), counts.data_ptr(), topk_idx.data_ptr(),
                                        topk_idx.shape[0], topk_idx.shape[1], num_experts, num_ranks)
    return msg[:n], experts[:n], counts.tolist()


def send_order_reference(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                         ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Plain-torch specification of ``send_order``; also the path for non-CPU devices."""
    flat = topk_idx.reshape(-1)
    msg = torch.nonzero(flat >= 0).reshape(-1)
    experts, order = torch.sort(flat[msg], stable=True)
    counts = torch.bincount(experts // (num_experts // num_ranks), minlength=num_ranks)
    return msg[order], experts, counts.tolist()


def combine_rows(layout_range: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """Flat rows ``e * rows_per_expert + row`` a low-latency combine returns, in send order: by
    source rank, then local expert, then row. ``layout_range`` `[E_loc, R]` int64 (begin << 32 |
    count). Reference: ``combine_rows_reference``."""
    if layout_range.device.type != "cpu":
        return combine_rows_reference(layout_range, rows_per_expert)
    local, num_ranks = layout_range.shape
    layout_range = layout_range.contiguous()
    rows = torch.empty(local * rows_per_expert, dtype=torch.int64)
    n = native().low_latency_combine_rows(rows.data_ptr(), layout_range.data_ptr(), local, num_ranks, rows_per_expert)
    return rows[:n]


def combine_rows_reference(layout_range: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """Plain-torch specification of ``combine_rows``; also the path for non-CPU devices."""
    local, num_ranks = layout_range.shape
    device = layout_range.device
    counts, begins = (layout_range & 0xFFFFFFFF).t().reshape(-1), (layout_range >> 32).t().reshape(-1)  # (s, e)
    block = torch.repeat_interleave(torch.arange(num_ranks * local, device=device), counts)
    within = torch.arange(block.shape[0], device=device) - (counts.cumsum(0) - counts)[block]
    return (block % local) * rows_per_expert + begins[block] + within


def low_latency_unpack(layout: RecordLayout, records: torch.Tensor, recv_counts: Sequence[int],
                       recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor], src_info: torch.Tensor,
                       layout_range: torch.Tensor, recv_count: torch.Tensor) -> None:
    """Scatters records into DeepEP's low-latency outputs. Local; deterministic.

    Args:
        layout: fields ``x`` (`[H]`), optional ``scales`` (`[S]`), ``src`` and ``expert`` (int32 `[1]` each).
        records: `[N, record_bytes]` uint8, ``recv_counts[s]`` records from each source rank s in
            order, each source's ordered by local expert, then token.
        recv_x: `[E_loc, rows, H]` contiguous, x's element size; written at the valid rows only.
        recv_scales: `[E_loc, rows, S]` any strides (DeepEP's column-major view), or None.
        src_info: `[E_loc, rows]` int32 contiguous; layout_range `[E_loc, R]` int64; recv_count `[E_loc]` int32.
    Row ``begin[e, s] + j`` of expert e holds record j of source s's block for e, blocks by source
    rank ascending; ``layout_range[e, s] = begin << 32 | count``.
    Reference: ``low_latency_unpack_reference``.
    """
    if records.device.type != "cpu":
        return low_latency_unpack_reference(layout, records, recv_counts, recv_x, recv_scales, src_info,
                                            layout_range, recv_count)
    local, rows, _ = recv_x.shape
    x, src, expert = layout.field("x"), layout.field("src"), layout.field("expert")
    scales_ptr = scales_offset = num_scales = scale_bytes = 0
    strides = (0, 0, 0)
    if recv_scales is not None:
        f = layout.field("scales")
        scales_ptr, scales_offset, num_scales, scale_bytes = recv_scales.data_ptr(), f.offset, f.num_cols, f.dtype.itemsize
        strides = tuple(s * recv_scales.element_size() for s in recv_scales.stride())
    counts = torch.tensor(list(recv_counts), dtype=torch.int64)
    native().low_latency_unpack(recv_x.data_ptr(), scales_ptr, src_info.data_ptr(), recv_count.data_ptr(),
                                layout_range.data_ptr(), records.data_ptr(), counts.data_ptr(), len(recv_counts),
                                local, rows, layout.record_bytes, x.offset, x.nbytes, scales_offset, num_scales,
                                scale_bytes, *strides, src.offset, expert.offset, cpu_threads())


def low_latency_unpack_reference(layout: RecordLayout, records: torch.Tensor, recv_counts: Sequence[int],
                                 recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor], src_info: torch.Tensor,
                                 layout_range: torch.Tensor, recv_count: torch.Tensor) -> None:
    """Plain-torch specification of ``low_latency_unpack``; also the path for non-CPU devices."""
    num_ranks, device = len(recv_counts), records.device
    local, rows, hidden = recv_x.shape
    num = records.shape[0]
    source = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                     torch.tensor(list(recv_counts), device=device))
    expert = layout.view(records, "expert")[:, 0].to(torch.int64)
    if num and (int(expert.min()) < 0 or int(expert.max()) >= local):
        raise ValueError(f"low_latency_unpack: records name local experts outside [0, {local})")
    counts = torch.bincount(expert * num_ranks + source, minlength=local * num_ranks).view(local, num_ranks)
    if int(counts.sum(1).max()) > rows:
        raise ValueError(f"low_latency_unpack: an expert receives more than its {rows} rows")
    begins = counts.cumsum(1) - counts
    arrival = counts.t().reshape(-1)  # blocks in arrival order (s, e)
    block_start = arrival.cumsum(0) - arrival
    row = begins[expert, source] + torch.arange(num, device=device) - block_start[source * local + expert]
    outputs = [recv_x.view(local * rows, hidden)] + [None] * (len(layout.fields) - 1)
    unpack_rows(layout, records, outputs, dst_rows=expert * rows + row)
    if recv_scales is not None:
        recv_scales[expert, row] = layout.view(records, "scales")
    src_info[expert, row] = layout.view(records, "src")[:, 0]
    recv_count.copy_(counts.sum(1))
    layout_range.copy_((begins << 32) | counts)
