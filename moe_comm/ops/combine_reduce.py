"""The combine reduction: sum each token's returned rows in a fixed order, optionally weighted, plus biases.
Returned rows are plain floats, or LogFMT-10 rows (``x_format="logfmt"``, DeepEP's ``use_logfmt`` combine)
decoded straight into the accumulation, one pass."""
from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch

from ..core.native import NATIVE_DTYPES, cpu_threads, native, native_dtype
from .logfmt import logfmt_decode_reference, logfmt_row_bytes
from .records import RecordLayout, check_records
from .rows import check_index

__all__ = ["combine_reduce", "combine_reduce_reference", "Records", "XFormat"]

#: The rows a reduction reads: one `[rows, record_bytes]` uint8 tensor for every source, or one per source.
Records = Union[torch.Tensor, Sequence[torch.Tensor]]
#: How field ``x`` holds a returned row: ``plain`` elements, or one LogFMT-10 row (``ops/logfmt.py``).
XFormat = Literal["plain", "logfmt"]


def _per_source(records: Records, num_sources: int) -> list[torch.Tensor]:
    if isinstance(records, torch.Tensor):
        return [records] * num_sources
    if len(records) != num_sources:
        raise ValueError(f"combine_reduce: records must be one tensor or one per source ({num_sources}), "
                         f"got {len(records)}")
    return list(records)


def combine_reduce(layout: RecordLayout, records: Records, send_pos: torch.Tensor,
                   bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                   out: torch.Tensor, out_weights: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None,
                   *, x_format: XFormat = "plain") -> None:
    """Reduces returned rows per original token. Local; deterministic.

    Args:
        layout: record layout with field ``x`` and, when ``out_weights`` is given, field ``weights``
            (`[num_topk]` float32). ``x`` is `[hidden]` of a ``moe_comm.core.native.NATIVE_DTYPES`` dtype, or with
            ``x_format="logfmt"`` `[logfmt_row_bytes(hidden)]` uint8 holding a LogFMT-10 row of hidden = out's
            columns, each decoded exactly as ``logfmt_decode`` decodes it (no out_weights then).
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
        x_format: ``"plain"`` or ``"logfmt"`` (see ``layout``); with ``"logfmt"`` out and the biases may be
            any ``NATIVE_DTYPES`` dtype (bf16 in DeepEP's combine).
    Reference: ``combine_reduce_reference`` (tests compare bitwise).
    """
    num_tokens, num_sources = send_pos.shape
    sources = _per_source(records, num_sources)
    logfmt = _is_logfmt(x_format)
    if logfmt:
        _check_logfmt_field(layout, out, out_weights)
    if out.device.type != "cpu":
        return combine_reduce_reference(layout, sources, send_pos, bias0, bias1, out, out_weights, scale,
                                        x_format=x_format)
    x_field = layout.field("x")
    w_offset, num_topk = 0, 0
    if out_weights is not None:
        w_field = layout.field("weights")
        w_offset, num_topk = w_field.offset, w_field.num_cols
    hidden, dtype = (out.shape[1], out.dtype) if logfmt else (x_field.num_cols, x_field.dtype)
    _check_native(layout, sources, send_pos, bias0, bias1, out, out_weights, scale, num_topk, hidden, dtype)
    send_pos, scale, bias0, bias1 = (None if t is None else t.contiguous() for t in (send_pos, scale, bias0, bias1))
    ptrs = [0 if t is None else t.data_ptr() for t in (send_pos, scale, bias0, bias1)]
    bases, rows = [r.data_ptr() for r in sources], [r.shape[0] for r in sources]
    if logfmt:
        native().combine_reduce_logfmt(out.data_ptr(), bases, rows, *ptrs, num_tokens, num_sources, hidden,
                                       native_dtype(dtype), layout.record_bytes, x_field.offset, cpu_threads())
    else:
        native().combine_reduce(out.data_ptr(), 0 if out_weights is None else out_weights.data_ptr(), bases, rows,
                                *ptrs, num_tokens, num_sources, hidden, native_dtype(dtype), layout.record_bytes,
                                x_field.offset, w_offset, num_topk, cpu_threads())


def _is_logfmt(x_format: XFormat) -> bool:
    if x_format not in ("plain", "logfmt"):
        raise ValueError(f"combine_reduce: x_format must be 'plain' or 'logfmt', got {x_format!r}")
    return x_format == "logfmt"


def _check_logfmt_field(layout: RecordLayout, out: torch.Tensor, out_weights: Optional[torch.Tensor]) -> None:
    """With x_format="logfmt": out is [num_tokens, hidden], field x holds logfmt_row_bytes(hidden) bytes, and
    there are no out_weights."""
    x_field = layout.field("x")
    if out.dim() != 2 or out.dtype not in NATIVE_DTYPES:
        raise ValueError(f"combine_reduce: with x_format='logfmt', out must be [num_tokens, hidden] of one of "
                         f"{[str(d) for d in NATIVE_DTYPES]}, got {list(out.shape)} {out.dtype}")
    row_bytes = logfmt_row_bytes(out.shape[1])
    if x_field.dtype != torch.uint8 or x_field.num_cols != row_bytes:
        raise ValueError(f"combine_reduce: with x_format='logfmt', field x must be [{row_bytes}] uint8 "
                         f"(logfmt_row_bytes({out.shape[1]})), got [{x_field.num_cols}] {x_field.dtype}")
    if out_weights is not None:
        raise ValueError("combine_reduce: x_format='logfmt' reduces rows only; out_weights must be None, "
                         f"got {list(out_weights.shape)} {out_weights.dtype}")


def _check_native(layout: RecordLayout, sources: list[torch.Tensor], send_pos: torch.Tensor,
                  bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor], out: torch.Tensor,
                  out_weights: Optional[torch.Tensor], scale: Optional[torch.Tensor], num_topk: int,
                  hidden: int, dtype: torch.dtype) -> None:
    """What the native kernel trusts about the memory behind its pointers (send_pos's entries it checks itself);
    out and the biases are `[num_tokens, hidden]` ``dtype``."""
    num_tokens, num_sources = send_pos.shape
    shape = (num_tokens, hidden)
    for j, r in enumerate(sources):
        check_records("combine_reduce", "records", r, layout.record_bytes, j)
    expected = [("send_pos", send_pos, (num_tokens, num_sources), torch.int32), ("out", out, shape, dtype),
                ("bias0", bias0, shape, dtype), ("bias1", bias1, shape, dtype),
                ("out_weights", out_weights, (num_tokens, num_topk), torch.float32),
                ("scale", scale, (num_tokens, num_sources), torch.float32)]
    for name, t, want, want_dtype in expected:
        if t is not None and (t.shape != want or t.dtype != want_dtype or not t.is_cpu):
            raise ValueError(f"combine_reduce: {name} must be {list(want)} {want_dtype} on the CPU, "
                             f"got {list(t.shape)} {t.dtype} on {t.device}")
    for name, t in (("out", out), ("out_weights", out_weights)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"combine_reduce: {name} must be contiguous, got strides {t.stride()}")


def combine_reduce_reference(layout: RecordLayout, records: Records, send_pos: torch.Tensor,
                             bias0: Optional[torch.Tensor], bias1: Optional[torch.Tensor],
                             out: torch.Tensor, out_weights: Optional[torch.Tensor],
                             scale: Optional[torch.Tensor] = None, *, x_format: XFormat = "plain") -> None:
    """Plain-torch specification of ``combine_reduce``; also the path for non-CPU devices. LogFMT rows are
    decoded by ``logfmt_decode_reference`` and then added exactly as plain rows are."""
    logfmt = _is_logfmt(x_format)
    if logfmt:
        _check_logfmt_field(layout, out, out_weights)
    hidden = out.shape[1] if logfmt else layout.field("x").num_cols
    num_tokens, num_sources = send_pos.shape
    sources = _per_source(records, num_sources)
    rows = torch.tensor([r.shape[0] for r in sources], dtype=torch.int64, device=send_pos.device)
    check_index("combine_reduce", "send_pos", send_pos, -1, rows, lambda pos: f"rows of source {pos[1]}")
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=out.device)
    wacc = None if out_weights is None else torch.zeros(out_weights.shape, dtype=torch.float32, device=out.device)
    for j in range(num_sources):
        pos = send_pos[:, j].long()
        hit = pos >= 0
        rows = layout.view(sources[j], "x")[pos[hit]]
        rows = logfmt_decode_reference(rows, hidden) if logfmt else rows.float()
        acc[hit] += rows if scale is None else scale[hit, j:j + 1] * rows
        if wacc is not None:
            wacc[hit] += layout.view(sources[j], "weights")[pos[hit]]
    for bias in (bias0, bias1):
        if bias is not None:
            acc += bias.float()
    out.copy_(acc)
    if out_weights is not None:
        out_weights.copy_(wacc)
