"""Where low-latency messages go: the send order of one (token, expert) message each, the rows a
combine returns, and the receive that places each record in its expert's fixed block."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..core.memory import empty
from ..core.native import cpu_threads, native
from ..ops.fp8 import FP8_DTYPE
from ..ops.quant import scales_shape
from ..ops.records import RecordLayout, check_records, unpack_rows
from ..ops.rows import check_index, check_on_cpu
from .codes import Fp8Format

__all__ = ["dispatch_record_layout", "send_order", "send_order_reference", "combine_positions",
           "combine_positions_reference", "combine_rows", "combine_rows_reference", "low_latency_unpack",
           "low_latency_unpack_reference", "layout_range_check", "layout_range_check_reference", "dispatch_outputs",
           "add_stats"]


def dispatch_record_layout(hidden: int, fp8_format: Fp8Format) -> RecordLayout:
    """The record of one low-latency dispatch message: ``x`` (bf16, or the FP8 codes as bytes), the FP8
    ``scales`` (fp32 per 128 channels, or UE8M0 bytes packed in int32), the source token ``src`` and the
    local ``expert`` (int32 each)."""
    specs = [("x", torch.bfloat16, hidden)]
    if fp8_format is not Fp8Format.BF16:
        (_, num_scales), dtype = scales_shape(1, hidden, "fp8", fp8_format.ue8m0)
        specs = [("x", torch.uint8, hidden), ("scales", dtype, num_scales)]
    return RecordLayout.build(specs + [("src", torch.int32, 1), ("expert", torch.int32, 1)])


def send_order(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The messages of ``topk_idx`` `[T, K]` int64 (-1 = none) in send order: by expert id (so by
    destination rank, then local expert), then token. Returns (``t * K + k`` `[S]` int64, expert
    `[S]` int64, messages per destination rank). An id outside [-1, num_experts) is a ValueError naming it.
    Reference: ``send_order_reference``."""
    if topk_idx.device.type != "cpu":
        return send_order_reference(topk_idx, num_experts, num_ranks)
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"send_order: topk_idx must be [T, K] int64, got {list(topk_idx.shape)} {topk_idx.dtype}")
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
    check_index("low_latency_send_order", "topk_idx", topk_idx, -1, num_experts, f"expert ids of {num_experts} experts")
    flat = topk_idx.reshape(-1)
    msg = torch.nonzero(flat >= 0).reshape(-1)
    experts, order = torch.sort(flat[msg], stable=True)
    counts = torch.bincount(experts // (num_experts // num_ranks), minlength=num_ranks)
    return msg[order], experts, counts.tolist()


def combine_positions(msg: torch.Tensor, experts: torch.Tensor, num_slots: int, num_local_experts: int,
                      num_ranks: int, firsts: Sequence[int]) -> torch.Tensor:
    """Where a low-latency combine finds each message's returned row: ``msg`` and ``experts`` are
    ``send_order``'s; the j-th message sent to rank d comes back as row ``firsts[d] + j`` of the received
    records. Returns ``pos`` `[num_slots]` int32 (``num_slots = T * K``), -1 for slots that sent nothing.
    ValueError for an entry outside its range. Reference: ``combine_positions_reference``."""
    if msg.device.type != "cpu":
        return combine_positions_reference(msg, experts, num_slots, num_local_experts, num_ranks, firsts)
    for name, t in (("msg", msg), ("experts", experts)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] != msg.shape[0]:
            raise ValueError(f"combine_positions: {name} must be [S] int64 like msg, got {list(t.shape)} {t.dtype}")
    msg, experts = msg.contiguous(), experts.contiguous()
    pos = torch.empty(num_slots, dtype=torch.int32)
    native().low_latency_positions(pos.data_ptr(), num_slots, msg.data_ptr(), experts.data_ptr(), msg.shape[0],
                                   num_local_experts, num_ranks, [int(f) for f in firsts])
    return pos


def combine_positions_reference(msg: torch.Tensor, experts: torch.Tensor, num_slots: int, num_local_experts: int,
                                num_ranks: int, firsts: Sequence[int]) -> torch.Tensor:
    """Plain-torch specification of ``combine_positions``; also the path for non-CPU devices."""
    check_index("low_latency_positions", "msg", msg, 0, num_slots, f"slots of num_slots={num_slots}")
    check_index("low_latency_positions", "experts", experts, 0, num_local_experts * num_ranks,
                f"experts of {num_local_experts * num_ranks}")
    device = msg.device
    dest = experts // num_local_experts
    counts = torch.bincount(dest, minlength=num_ranks)
    before = counts.cumsum(0) - counts  # messages to ranks below d, in send order (grouped by destination)
    order = torch.argsort(dest, stable=True)
    within = torch.empty_like(dest)
    within[order] = torch.arange(dest.shape[0], device=device) - before[dest[order]]
    pos = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
    pos[msg] = (torch.tensor([int(f) for f in firsts], device=device)[dest] + within).to(torch.int32)
    return pos


def combine_rows(layout_range: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """Flat rows ``e * rows_per_expert + row`` a low-latency combine returns, in send order: by
    source rank, then local expert, then row. ``layout_range`` `[E_loc, R]` int64 (begin << 32 |
    count): every range inside ``[0, rows_per_expert)`` and at most ``E_loc * rows_per_expert`` rows in all,
    else ValueError. Reference: ``combine_rows_reference``."""
    if layout_range.device.type != "cpu":
        return combine_rows_reference(layout_range, rows_per_expert)
    if layout_range.dim() != 2 or layout_range.dtype != torch.int64:
        raise ValueError(f"combine_rows: layout_range must be [E_loc, R] int64, got {list(layout_range.shape)} "
                         f"{layout_range.dtype}")
    local, num_ranks = layout_range.shape
    layout_range = layout_range.contiguous()
    rows = torch.empty(local * rows_per_expert, dtype=torch.int64)
    n = native().low_latency_combine_rows(rows.data_ptr(), layout_range.data_ptr(), local, num_ranks, rows_per_expert,
                                          rows.shape[0])
    return rows[:n]


def combine_rows_reference(layout_range: torch.Tensor, rows_per_expert: int) -> torch.Tensor:
    """Plain-torch specification of ``combine_rows``; also the path for non-CPU devices."""
    local, num_ranks = layout_range.shape
    device = layout_range.device
    counts, begins = (layout_range & 0xFFFFFFFF).t().reshape(-1), (layout_range >> 32).t().reshape(-1)  # (s, e)
    first, count = layout_range >> 32, layout_range & 0xFFFFFFFF  # [E_loc, R]
    bad = (first < 0) | (first + count > rows_per_expert)
    if bool(bad.any()):
        e, s = (int(i) for i in torch.nonzero(bad)[0])  # the first in the native check's order (expert-major)
        b, c = int(first[e, s]), int(count[e, s])
        raise ValueError(f"low_latency_combine_rows: layout_range[{e}, {s}] = {int(layout_range[e, s])} (begin "
                         f"{b}, count {c}) spans rows [{b}, {b + c}), outside [0, {rows_per_expert}) (rows_per_expert)")
    if int(counts.sum()) > local * rows_per_expert:
        raise ValueError(f"low_latency_combine_rows: layout_range counts sum to more than max_rows="
                         f"{local * rows_per_expert} (the room in rows; overlapping ranges?)")
    block = torch.repeat_interleave(torch.arange(num_ranks * local, device=device), counts)
    within = torch.arange(block.shape[0], device=device) - (counts.cumsum(0) - counts)[block]
    return (block % local) * rows_per_expert + begins[block] + within


def layout_range_check(layout_range: torch.Tensor, rows_per_expert: int) -> Optional[tuple[int, int]]:
    """The first ``[e, s]`` of a low-latency handle's ``layout_range`` `[E_loc, R]` int64 (begin << 32 |
    count) whose block does not begin where source s - 1's ends (source 0's at 0), or does not end
    inside ``rows_per_expert``; None when every block does. Local. Reference: ``layout_range_check_reference``."""
    if layout_range.device.type != "cpu":
        return layout_range_check_reference(layout_range, rows_per_expert)
    local, num_ranks = layout_range.shape
    layout_range = layout_range.contiguous()
    first = native().low_latency_layout_check(layout_range.data_ptr(), local, num_ranks, rows_per_expert)
    return None if first < 0 else divmod(first, num_ranks)


def layout_range_check_reference(layout_range: torch.Tensor, rows_per_expert: int) -> Optional[tuple[int, int]]:
    """Plain-torch specification of ``layout_range_check``; also the path off the CPU."""
    begins, counts = layout_range >> 32, layout_range & 0xFFFFFFFF
    bad = (layout_range < 0) | (begins != counts.cumsum(1) - counts) | (begins + counts > rows_per_expert)
    wrong = bad.nonzero()
    return tuple(wrong[0].tolist()) if wrong.shape[0] else None


def low_latency_unpack(layout: RecordLayout, records: torch.Tensor, recv_counts: Sequence[int],
                       recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor], src_info: torch.Tensor,
                       layout_range: torch.Tensor, recv_count: torch.Tensor,
                       firsts: Optional[Sequence[int]] = None) -> None:
    """Scatters records into DeepEP's low-latency outputs. Local; deterministic.

    Args:
        layout: fields ``x`` (`[H]`), optional ``scales`` (`[S]`), ``src`` and ``expert`` (int32 `[1]` each).
        records: `[N, record_bytes]` uint8, ``recv_counts[s]`` records from each source rank s in
            order, each source's ordered by local expert, then token.
        recv_x: `[E_loc, rows, H]` contiguous, x's element size; every row written: rows past
            ``recv_count[e]`` are zero (their scales zero, their ``src_info`` -1).
        recv_scales: `[E_loc, rows, S]` any strides (DeepEP's column-major view), or None.
        src_info: `[E_loc, rows]` int32 contiguous; layout_range `[E_loc, R]` int64; recv_count `[E_loc]` int32.
        firsts: where each source's records start in ``records`` (a transport's fixed regions); None:
            packed, source after source from record 0.
    Row ``begin[e, s] + j`` of expert e holds record j of source s's block for e, blocks by source
    rank ascending; ``layout_range[e, s] = begin << 32 | count``. ValueError when ``recv_counts`` has a
    negative entry or a source's records lie outside ``records`` (packed: do not sum to ``N``), a record
    names an expert outside ``[0, E_loc)``, or an expert receives more than ``rows`` records.
    Reference: ``low_latency_unpack_reference``.
    """
    if records.device.type != "cpu":
        if firsts is not None:
            records = torch.cat([records[f:f + int(n)] for f, n in zip(firsts, recv_counts)])
        return low_latency_unpack_reference(layout, records, recv_counts, recv_x, recv_scales, src_info,
                                            layout_range, recv_count)
    _check_unpack_outputs(layout, records, len(recv_counts), recv_x, recv_scales, src_info, layout_range, recv_count)
    local, rows, _ = recv_x.shape
    x, src, expert = layout.field("x"), layout.field("src"), layout.field("expert")
    scales_ptr = scales_offset = num_scales = scale_bytes = 0
    strides = (0, 0, 0)
    if recv_scales is not None:
        f = layout.field("scales")
        scales_ptr, scales_offset, num_scales, scale_bytes = recv_scales.data_ptr(), f.offset, f.num_cols, f.dtype.itemsize
        strides = tuple(s * recv_scales.element_size() for s in recv_scales.stride())
    counts = torch.tensor(list(recv_counts), dtype=torch.int64)
    starts = None if firsts is None else torch.tensor(list(firsts), dtype=torch.int64)
    if starts is not None and starts.numel() != counts.numel():
        raise ValueError(f"low_latency_unpack: firsts has {starts.numel()} entries, recv_counts {counts.numel()}")
    native().low_latency_unpack(recv_x.data_ptr(), scales_ptr, src_info.data_ptr(), recv_count.data_ptr(),
                                layout_range.data_ptr(), records.data_ptr(), counts.data_ptr(),
                                0 if starts is None else starts.data_ptr(), records.shape[0],
                                len(recv_counts), local, rows, layout.record_bytes, x.offset, x.nbytes, scales_offset,
                                num_scales, scale_bytes, *strides, src.offset, expert.offset, cpu_threads())


def _check_unpack_outputs(layout: RecordLayout, records: torch.Tensor, num_ranks: int, recv_x: torch.Tensor,
                          recv_scales: Optional[torch.Tensor], src_info: torch.Tensor, layout_range: torch.Tensor,
                          recv_count: torch.Tensor) -> None:
    """What the native kernel trusts about the memory behind its pointers (it checks the counts and ids itself)."""
    op = "low_latency_unpack"
    check_records(op, "records", records, layout.record_bytes)
    check_on_cpu(op, dict(recv_x=recv_x, recv_scales=recv_scales, src_info=src_info, layout_range=layout_range,
                          recv_count=recv_count))
    x = layout.field("x")
    if recv_x.dim() != 3 or recv_x.shape[2] * recv_x.element_size() != x.nbytes or not recv_x.is_contiguous():
        raise ValueError(f"{op}: recv_x must be a contiguous [E_loc, rows, H] tensor of {x.nbytes}-byte rows, got "
                         f"{list(recv_x.shape)} {recv_x.dtype} strides {recv_x.stride()}")
    local, rows = recv_x.shape[:2]
    expected = [("src_info", src_info, (local, rows), torch.int32), ("layout_range", layout_range, (local, num_ranks),
                                                                      torch.int64),
                ("recv_count", recv_count, (local,), torch.int32)]
    for name, t, shape, dtype in expected:
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous {list(shape)} {dtype}, got {list(t.shape)} {t.dtype} "
                             f"strides {t.stride()}")
    for name in ("src", "expert"):
        if layout.field(name).nbytes != 4:
            raise ValueError(f"{op}: field {name} must be one int32, got {layout.field(name)}")
    if recv_scales is not None:
        f = layout.field("scales")
        if (tuple(recv_scales.shape) != (local, rows, f.num_cols) or recv_scales.element_size() != f.dtype.itemsize
                or min(recv_scales.stride(), default=0) < 0):
            raise ValueError(f"{op}: recv_scales must be [{local}, {rows}, {f.num_cols}] of {f.dtype.itemsize}-byte "
                             f"elements, got {list(recv_scales.shape)} {recv_scales.dtype}")


def _check_recv_counts(recv_counts: Sequence[int], num_records: int) -> None:
    counted = 0
    for s, n in enumerate(recv_counts):
        if n < 0 or n > num_records - counted:
            raise ValueError(f"low_latency_unpack: recv_counts[{s}] = {n} is outside [0, {num_records - counted}] "
                             f"(records left of num_records={num_records})")
        counted += n
    if counted != num_records:
        raise ValueError(f"low_latency_unpack: recv_counts sum to {counted}, but records holds num_records="
                         f"{num_records}")


def low_latency_unpack_reference(layout: RecordLayout, records: torch.Tensor, recv_counts: Sequence[int],
                                 recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor], src_info: torch.Tensor,
                                 layout_range: torch.Tensor, recv_count: torch.Tensor) -> None:
    """Plain-torch specification of ``low_latency_unpack``; also the path for non-CPU devices."""
    num_ranks, device = len(recv_counts), records.device
    local, rows, hidden = recv_x.shape
    num = records.shape[0]
    _check_recv_counts(recv_counts, num)
    source = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                     torch.tensor(list(recv_counts), device=device))
    expert = layout.view(records, "expert")[:, 0].to(torch.int64)
    bad = (expert < 0) | (expert >= local)
    if bool(bad.any()):
        j = int(torch.nonzero(bad)[0])
        raise ValueError(f"low_latency_unpack: record {j} from rank {int(source[j])} names local expert "
                         f"{int(expert[j])}, outside [0, {local})")
    block = expert * num_ranks + source  # (e, s)
    counts = torch.bincount(block, minlength=local * num_ranks).view(local, num_ranks)
    per_expert = counts.sum(1)
    if bool((per_expert > rows).any()):
        e = int(torch.nonzero(per_expert > rows)[0])
        raise ValueError(f"low_latency_unpack: local expert {e} receives {int(per_expert[e])} rows, more than its "
                         f"{rows}")
    begins = counts.cumsum(1) - counts
    # Record j's place in its (e, s) block: how many records of that block arrived before it. (Equal to
    # j minus the block's first record when each source's records come ordered by expert, as they are
    # sent; counted like this, records out of that order still land inside their expert's rows.)
    order = torch.argsort(block, stable=True)
    flat = counts.reshape(-1)
    within = torch.empty_like(block)
    within[order] = torch.arange(num, device=device) - (flat.cumsum(0) - flat)[block[order]]
    row = begins[expert, source] + within
    padding = torch.arange(rows, device=device) >= per_expert.unsqueeze(1)  # [E_loc, rows]
    recv_x.masked_fill_(padding.unsqueeze(2), 0)
    if recv_scales is not None:
        recv_scales.masked_fill_(padding.unsqueeze(2), 0)
    src_info.masked_fill_(padding, -1)
    outputs = [recv_x.view(local * rows, hidden)] + [None] * (len(layout.fields) - 1)
    unpack_rows(layout, records, outputs, dst_rows=expert * rows + row)
    if recv_scales is not None:
        recv_scales[expert, row] = layout.view(records, "scales")
    src_info[expert, row] = layout.view(records, "src")[:, 0]
    recv_count.copy_(counts.sum(1))
    layout_range.copy_((begins << 32) | counts)


def dispatch_outputs(local: int, num_ranks: int, m: int, hidden: int, scales: Optional[tuple[torch.dtype, int]],
                     device: torch.device
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dispatch's outputs before any row arrives, ``rows = num_ranks * m``, uninitialised (recycled
    memory, ``core.memory.empty``): recv_x `[E_loc, rows, H]` (float8_e4m3fn when ``scales`` (dtype, S)
    is given, else bf16), recv_scales allocated `[E_loc, S, rows]` and returned transposed (DeepEP's
    layout), src_info `[E_loc, rows]` int32, layout_range `[E_loc, R]` int64 and recv_count `[E_loc]`
    int32. The receive writes every row, the padding past each count included (``low_latency_unpack``,
    the kernels' dispatch receive), so outputs are bitwise reproducible."""
    rows = num_ranks * m
    recv_x = empty((local, rows, hidden), torch.bfloat16 if scales is None else FP8_DTYPE, device)
    recv_scales = None
    if scales is not None:
        recv_scales = empty((local, scales[1], rows), scales[0], device).transpose(1, 2)
    src_info = torch.empty((local, rows), dtype=torch.int32, device=device)
    layout_range = torch.empty(local, num_ranks, dtype=torch.int64, device=device)
    return recv_x, recv_scales, src_info, layout_range, torch.empty(local, dtype=torch.int32, device=device)


def add_stats(recv_stats: Optional[torch.Tensor], recv_count: Optional[torch.Tensor],
              wait_stats: Optional[torch.Tensor], waited_ns: int) -> None:
    """DeepEP's optional stats tensors after a receive: ``recv_stats += recv_count`` (a dispatch's),
    ``wait_stats += waited_ns`` (the handshake's and the receive's waits)."""
    if recv_stats is not None:
        recv_stats.add_(recv_count)
    if wait_stats is not None:
        wait_stats.add_(waited_ns)
