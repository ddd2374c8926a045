"""Row records: several per-token fields packed into one row of bytes, so one exchange moves them all.

A record is the concatenation of fields (e.g. hidden bytes, FP8 scales, top-k ids, top-k weights,
source index); each field starts at an 8-byte-aligned offset so it can be viewed in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .._native import cpu_threads, native

__all__ = ["Field", "RecordLayout", "pack_rows", "pack_rows_reference", "unpack_rows", "unpack_rows_reference",
           "gather_rows", "gather_rows_reference"]

_ALIGN = 8


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    num_cols: int
    offset: int  # byte offset inside a record, a multiple of 8

    @property
    def nbytes(self) -> int:
        return self.num_cols * self.dtype.itemsize


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one record (``build`` makes ``record_bytes`` a multiple of 8; the kernels need not)."""

    fields: tuple[Field, ...]
    record_bytes: int

    @staticmethod
    def build(specs: Sequence[tuple[str, torch.dtype, int]]) -> "RecordLayout":
        """Lays out ``(name, dtype, num_cols)`` fields in order, each 8-byte aligned."""
        fields, offset = [], 0
        for name, dtype, num_cols in specs:
            fields.append(Field(name, dtype, num_cols, offset))
            offset += -(-num_cols * dtype.itemsize // _ALIGN) * _ALIGN
        return RecordLayout(tuple(fields), max(offset, _ALIGN))

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"RecordLayout has no field {name!r}; fields: {[f.name for f in self.fields]}")

    def view(self, records: torch.Tensor, name: str) -> torch.Tensor:
        """Field ``name`` of every record as a strided ``[rows, num_cols]`` tensor of its dtype."""
        f = self.field(name)
        return records[:, f.offset:f.offset + f.nbytes].view(f.dtype)


def _segments(layout: RecordLayout, tensors: Sequence[Optional[torch.Tensor]]
              ) -> list[tuple[int, int, int, int, int, int]]:
    segs = []
    for f, t in zip(layout.fields, tensors):
        if f.num_cols == 0 or t is None:
            continue
        item = t.element_size()
        segs.append((t.data_ptr(), t.stride(0) * item, t.stride(1) * item, item, f.num_cols, f.offset))
    return segs


def _check(layout: RecordLayout, tensors: Sequence[Optional[torch.Tensor]], op: str) -> None:
    if len(tensors) != len(layout.fields):
        raise ValueError(f"{op}: expected {len(layout.fields)} tensors ({[f.name for f in layout.fields]}), "
                         f"got {len(tensors)}")
    for f, t in zip(layout.fields, tensors):
        if t is None:
            continue
        if t.dim() != 2 or t.shape[1] != f.num_cols or t.dtype.itemsize != f.dtype.itemsize:
            raise ValueError(f"{op}: field {f.name} must be [rows, {f.num_cols}] with {f.dtype.itemsize}-byte "
                             f"elements, got {list(t.shape)} {t.dtype}")


def pack_rows(layout: RecordLayout, fields: Sequence[Optional[torch.Tensor]], src_rows: torch.Tensor,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gathers rows into records. Local; no host sync on non-CPU devices.

    Args:
        fields: one 2-D tensor per layout field, any strides, rows indexed by ``src_rows``; None
            leaves that field's bytes unwritten (for a per-record value the caller writes through
            ``layout.view``).
        src_rows: `[num_records]` int64, the source row of each record (any order, repeats allowed);
            -1 writes zeros to the record's fields.
        out: optional `[num_records, record_bytes]` uint8 with contiguous rows to write into.
    Returns:
        `[num_records, record_bytes]` uint8 (``out`` when given); bytes between fields are unspecified.
    Reference: ``pack_rows_reference`` (tests compare the field bytes exactly).
    """
    _check(layout, fields, "pack_rows")
    num_rows = src_rows.shape[0]
    if out is not None and (tuple(out.shape) != (num_rows, layout.record_bytes) or out.dtype != torch.uint8
                            or out.stride() != (layout.record_bytes, 1)):
        raise ValueError(f"pack_rows: out must be a contiguous [{num_rows}, {layout.record_bytes}] uint8 tensor, "
                         f"got {list(out.shape)} {out.dtype} strides {out.stride()}")
    if src_rows.device.type != "cpu":
        records = pack_rows_reference(layout, fields, src_rows)
        return records if out is None else out.copy_(records)
    records = torch.empty(num_rows, layout.record_bytes, dtype=torch.uint8) if out is None else out
    src_rows = src_rows.contiguous()
    native().pack_rows(records.data_ptr(), _segments(layout, fields), src_rows.data_ptr(), num_rows,
                       layout.record_bytes, cpu_threads())
    return records


def pack_rows_reference(layout: RecordLayout, fields: Sequence[Optional[torch.Tensor]],
                        src_rows: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of ``pack_rows``; also the path for non-CPU devices."""
    records = torch.zeros(src_rows.shape[0], layout.record_bytes, dtype=torch.uint8, device=src_rows.device)
    for f, t in zip(layout.fields, fields):
        if f.num_cols and t is not None:
            rows = t.index_select(0, src_rows.clamp(min=0)).contiguous().view(torch.uint8).reshape(-1, f.nbytes)
            rows[src_rows < 0] = 0
            records[:, f.offset:f.offset + f.nbytes] = rows
    return records


def unpack_rows(layout: RecordLayout, records: torch.Tensor, outputs: Sequence[Optional[torch.Tensor]],
                dst_rows: Optional[torch.Tensor] = None) -> None:
    """Scatters records into ``outputs``: row ``dst_rows[i]`` (row i without ``dst_rows``) of each
    output receives its field of record i.

    Args:
        records: `[num_records, record_bytes]` uint8, rows contiguous.
        outputs: one 2-D tensor (any strides) per layout field, written in place; None skips a field.
        dst_rows: optional `[num_records]` int64 of distinct rows inside every output.
    Reference: ``unpack_rows_reference``.
    """
    _check(layout, outputs, "unpack_rows")
    if records.device.type != "cpu":
        return unpack_rows_reference(layout, records, outputs, dst_rows)
    num_rows = records.shape[0]
    if dst_rows is not None:
        dst_rows = dst_rows.contiguous()
    native().unpack_rows(_segments(layout, outputs), records.data_ptr(), 0 if dst_rows is None else dst_rows.data_ptr(),
                         num_rows, layout.record_bytes, cpu_threads())


def unpack_rows_reference(layout: RecordLayout, records: torch.Tensor, outputs: Sequence[Optional[torch.Tensor]],
                          dst_rows: Optional[torch.Tensor] = None) -> None:
    """Plain-torch specification of ``unpack_rows``; also the path for non-CPU devices."""
    num_rows = records.shape[0]
    for f, out in zip(layout.fields, outputs):
        if f.num_cols and out is not None:
            values = layout.view(records, f.name).view(out.dtype)
            if dst_rows is None:
                out[:num_rows].copy_(values)
            else:
                out[dst_rows] = values


def gather_rows(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[i] = src[rows[i]]``, zeros where ``rows[i] == -1``: 2-D tensors of one element size, ``out`` with
    contiguous rows, ``src`` any strides, ``rows`` `[out.shape[0]]` int64. Local. (On CPU the native row copy, whose
    large copies bypass the cache; ``torch.index_select`` does not.)
    Reference: ``gather_rows_reference``."""
    if (out.dim() != 2 or src.dim() != 2 or out.shape[1] != src.shape[1] or out.element_size() != src.element_size()
            or rows.shape != (out.shape[0],) or out.stride(1) != 1):
        raise ValueError(f"gather_rows: out {list(out.shape)} {out.dtype} (strides {out.stride()}), src "
                         f"{list(src.shape)} {src.dtype} and rows {list(rows.shape)} do not fit")
    if out.device.type != "cpu":
        return gather_rows_reference(out, src, rows)
    item = src.element_size()
    rows = rows.contiguous()
    segment = (src.data_ptr(), src.stride(0) * item, src.stride(1) * item, item, src.shape[1], 0)
    native().pack_rows(out.data_ptr(), [segment], rows.data_ptr(), rows.shape[0], out.stride(0) * item,
                       cpu_threads())


def gather_rows_reference(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain-torch specification of ``gather_rows``; also the path for non-CPU devices."""
    out.copy_(src.index_select(0, rows.clamp(min=0)).view(out.dtype))
    out.view(torch.uint8)[rows < 0] = 0
