"""The combine reduction: sum each token's returned rows in a fixed order, optionally weighted, plus biases."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .._native import cpu_threads, native, native_dtype
from .rows import check_index
from .records import RecordLayout, check_records

__all__ = ["combine_reduce", "combine_reduce_reference", "Records"]

#: The rows a reduction reads: one `[rows, record_bytes]` uint8 tensor for every source, or one per source.
Records = Union[torch.Tensor, Sequence[torch.Tensor]]


def _per_source(records: Records, num_sources: int) -> list[torch.Tensor]:
    if isinstance(records, torch.Tensor):
        return [records] * num_sources
    if len(records) != num_sources:
        raise ValueError(f"combine_reduce: records must be one tensor or one per source ({num_sources}), "
                         f"got {len(records)}")
    return list(records)


def combine_reduce(layout: RecordLayout, records: Records, send_pos: torch.Tensor,
                   bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                   out: torch.Tensor, out_weights: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None) -> None:
    """Reduces returned rows per original token. Local; deterministic.

    Args:
        layout: record layout with field ``x`` (`[hidden]` of a ``moe_comm._native.NATIVE_DTYPES`` dtype) and, when
            ``out_weights`` is given, field ``weights`` (`[num_topk]` float32).
        records: `[rows, record_bytes]` uint8 shared by all sources, or one such tensor per source
            (rows in place, e.g. a rank's own rows read straight from the combine input).
        send_pos: `[num_tokens, num_sources]` int32: record of token t from source j (a rank in
            normal mode, a top-k slot in low-latency mode) in source j's records, or -1; an entry
            outside [-1, rows of source j) is a ValueError naming it.
        bias0, bias1: optional `[num_tokens, hidden]` of x's dtype, contiguous.
        out: `[num_tokens, hidden]` x's dtype, contiguous, written with
            ``out[t] = round(((0 + s_0 * x_0 + s_1 * x_1 + ...) + bias0[t]) + bias1[t])`` over sources j
            ascending where send_pos[t, j] >= 0, all arithmetic in fp32 (multiply, then add).
        out_weights: optional `[num_tokens, num_topk]` float32, contiguous: the weights summed the
            same way, without biases or scales.
        scale: optional `[num_tokens, num_sources]` float32 weights s_j (1 when None).
    Reference: ``combine_reduce_reference`` (tests compare bitwise).
    """
    num_tokens, num_sources = send_pos.shape
    sources = _per_source(records, num_sources)
    if out.device.type != "cpu":
        return combine_reduce_reference(layout, sources, send_pos, bias0, bias1, out, out_weights, scale)
    x_field = layout.field("x")
    w_offset, num_topk = 0, 0
    if out_weights is not None:
        w_field = layout.field("weights")
        w_offset, num_topk = w_field.offset, w_field.num_cols
    _check_native(layout, sources, send_pos, bias0, bias1, out, out_weights, scale, num_topk)
    send_pos = send_pos.contiguous()
    if scale is not None:
        scale = scale.contiguous()
    bias0 = None if bias0 is None else bias0.contiguous()
    bias1 = None if bias1 is None else bias1.contiguous()
    native().combine_reduce(out.data_ptr(), 0 if out_weights is None else out_weights.data_ptr(),
                            [r.data_ptr() for r in sources], [r.shape[0] for r in sources],
                            send_pos.data_ptr(), 0 if scale is None else scale.data_ptr(),
                            0 if bias0 is None else bias0.data_ptr(), 0 if bias1 is None else bias1.data_ptr(),
                            num_tokens, num_sources, x_field.num_cols,
                            native_dtype(x_field.dtype), layout.record_bytes, x_field.offset, w_offset, num_topk,
                            cpu_threads())


def _check_native(layout: RecordLayout, sources: list[torch.Tensor], send_pos: torch.Tensor,
                  bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], out: torch.Tensor,
                  out_weights: Optional[torch.Tensor], scale: Optional[torch.Tensor], num_topk: int) -> None:
    """What the native kernel trusts about the memory behind its pointers (send_pos's entries it checks itself)."""
    x_field = layout.field("x")
    num_tokens, num_sources = send_pos.shape
    shape = (num_tokens, x_field.num_cols)
    for j, r in enumerate(sources):
        check_records("combine_reduce", "records", r, layout.record_bytes, j)
    expected = [("send_pos", send_pos, (num_tokens, num_sources), torch.int32), ("out", out, shape, x_field.dtype),
                ("bias0", bias0, shape, x_field.dtype), ("bias1", bias1, shape, x_field.dtype),
                ("out_weights", out_weights, (num_tokens, num_topk), torch.float32),
                ("scale", scale, (num_tokens, num_sources), torch.float32)]
    for name, t, want, dtype in expected:
        if t is not None and (t.shape != want or t.dtype != dtype or not t.is_cpu):
            raise ValueError(f"combine_reduce: {name} must be {list(want)} {dtype} on the CPU, got {list(t.shape)} "
                             f"{t.dtype} on {t.device}")
    for name, t in (("out", out), ("out_weights", out_weights)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"combine_reduce: {name} must be contiguous, got strides {t.stride()}")


def combine_reduce_reference(layout: RecordLayout, records: Records, send_pos: torch.Tensor,
                             bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                             out: torch.Tensor, out_weights: Optional[torch.Tensor],
                             scale: Optional[torch.Tensor] = None) -> None:
    """Plain-torch specification of ``combine_reduce``; also the path for non-CPU devices."""
    x_field = layout.field("x")
    num_tokens, num_sources = send_pos.shape
    sources = _per_source(records, num_sources)
    rows = torch.tensor([r.shape[0] for r in sources], dtype=torch.int64, device=send_pos.device)
    check_index("combine_reduce", "send_pos", send_pos, -1, rows, lambda pos: f"rows of source {pos[1]}")
    acc = torch.zeros(num_tokens, x_field.num_cols, dtype=torch.float32, device=out.device)
    wacc = None if out_weights is None else torch.zeros(out_weights.shape, dtype=torch.float32, device=out.device)
    for j in range(num_sources):
        pos = send_pos[:, j].long()
        hit = pos >= 0
        rows = layout.view(sources[j], "x").float()[pos[hit]]
        acc[hit] += rows if scale is None else scale[hit, j:j + 1] * rows
        if wacc is not None:
            wacc[hit] += layout.view(sources[j], "weights")[pos[hit]]
    for bias in (bias0, bias1):
        if bias is not None:
            acc += bias.float()
    out.copy_(acc)
    if out_weights is not None:
        out_weights.copy_(wacc)
