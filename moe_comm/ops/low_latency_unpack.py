"""The low-latency receive: place each received (token, expert) record in its expert's fixed block."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._native import cpu_threads, native
from .records import RecordLayout, unpack_rows

__all__ = ["low_latency_unpack", "low_latency_unpack_reference"]


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
