"""Row records: several per-token fields packed into one row of bytes, so one exchange moves them all.

A record is the concatenation of fields (e.g. hidden bytes, FP8 scales, top-k ids, top-k weights,
source index); each field starts at an 8-byte-aligned offset so it can be viewed in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..core.native import cpu_threads, native
from .rows import check_index, check_on_cpu, check_rows_index

__all__ = ["Field", "RecordLayout", "native_segments", "pack_rows", "pack_rows_reference", "unpack_rows", "unpack_rows_reference",
           "check_records"]

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


def check_records(op: str, name: str, records: torch.Tensor, record_bytes: int, source: Optional[int] = None,
                  cpu: bool = True) -> None:
    """Raises ValueError unless ``records`` is a contiguous `[rows, record_bytes]` uint8 tensor (what the native
    kernels read: record i at byte ``i * record_bytes``), on the CPU unless ``cpu`` is False. ``source``, when
    given, is named as ``name[source]``. Cheap enough for every call (a few attribute reads)."""
    if (isinstance(records, torch.Tensor) and records.dtype == torch.uint8 and records.dim() == 2
            and records.is_contiguous() and records.shape[1] == record_bytes and (records.is_cpu or not cpu)):
        return
    name = name if source is None else f"{name}[{source}]"
    got = (f"{list(records.shape)} {records.dtype} strides {records.stride()} on {records.device}"
           if isinstance(records, torch.Tensor) else type(records).__name__)
    raise ValueError(f"{op}: {name} must be a contiguous [rows, {record_bytes}] uint8 tensor"
                     f"{' on the CPU' if cpu else ''}, got {got}")


def native_segments(layout: RecordLayout, tensors: Sequence[Optional[torch.Tensor]], op: str = ""
                    ) -> list[tuple[int, int, int, int, int, int, int]]:
    """The native API's segment tuples: (data_ptr, row_stride_B, col_stride_B, elem_B, num_cols, offset_B,
    num_rows); num_rows is the tensor's own row count, which the kernels check every row index against.
    With ``op``, first checks the tensors against the layout and that they are on the CPU (ValueError
    naming ``op``), as ``pack_rows`` does: what the kernels trust about the memory behind a segment."""
    if op:
        _check(layout, tensors, op)
        check_on_cpu(op, {f"field {f.name}": t for f, t in zip(layout.fields, tensors)})
    segs = []
    for f, t in zip(layout.fields, tensors):
        if f.num_cols == 0 or t is None:
            continue
        item = t.element_size()
        segs.append((t.data_ptr(), t.stride(0) * item, t.stride(1) * item, item, f.num_cols, f.offset, t.shape[0]))
    return segs


def _fewest_rows(layout: RecordLayout, tensors: Sequence[Optional[torch.Tensor]]
                 ) -> Optional[tuple[Field, torch.Tensor]]:
    """The (field, tensor) with the fewest rows among those the kernels read or write: the bound of every
    row index (the first such when several tie, as in the native check)."""
    used = [(f, t) for f, t in zip(layout.fields, tensors) if f.num_cols and t is not None]
    return min(used, key=lambda ft: ft[1].shape[0]) if used else None


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
            -1 writes zeros to the record's fields. Every entry must be -1 or a row of every field
            (ValueError naming the entry otherwise).
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
    check_rows_index("pack_rows", "src_rows", src_rows, num_rows)
    check_on_cpu("pack_rows", {"out": out, **{f"field {f.name}": t for f, t in zip(layout.fields, fields)}})
    records = torch.empty(num_rows, layout.record_bytes, dtype=torch.uint8) if out is None else out
    src_rows = src_rows.contiguous()
    native().pack_rows(records.data_ptr(), native_segments(layout, fields), src_rows.data_ptr(), num_rows,
                       layout.record_bytes, cpu_threads())
    return records


def pack_rows_reference(layout: RecordLayout, fields: Sequence[Optional[torch.Tensor]],
                        src_rows: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of ``pack_rows``; also the path for non-CPU devices."""
    fewest = _fewest_rows(layout, fields)
    if fewest is not None:
        check_index("pack_rows", "src_rows", src_rows, -1, fewest[1].shape[0], f"rows of field {fewest[0].name}")
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
            Without ``dst_rows`` each needs at least num_records rows.
        dst_rows: optional `[num_records]` int64 of distinct rows inside every output (ValueError naming
            the entry otherwise).
    Reference: ``unpack_rows_reference``.
    """
    _check(layout, outputs, "unpack_rows")
    check_records("unpack_rows", "records", records, layout.record_bytes, cpu=False)
    if records.device.type != "cpu":
        return unpack_rows_reference(layout, records, outputs, dst_rows)
    num_rows = records.shape[0]
    if dst_rows is not None:
        check_rows_index("unpack_rows", "dst_rows", dst_rows, num_rows)
        dst_rows = dst_rows.contiguous()
    check_on_cpu("unpack_rows", {"dst_rows": dst_rows,
                                 **{f"output {f.name}": t for f, t in zip(layout.fields, outputs)}})
    native().unpack_rows(native_segments(layout, outputs), records.data_ptr(), 0 if dst_rows is None else dst_rows.data_ptr(),
                         num_rows, layout.record_bytes, cpu_threads())


def unpack_rows_reference(layout: RecordLayout, records: torch.Tensor, outputs: Sequence[Optional[torch.Tensor]],
                          dst_rows: Optional[torch.Tensor] = None) -> None:
    """Plain-torch specification of ``unpack_rows``; also the path for non-CPU devices."""
    num_rows = records.shape[0]
    fewest = _fewest_rows(layout, outputs)
    if fewest is not None:
        f, out = fewest
        if dst_rows is not None:
            check_index("unpack_rows", "dst_rows", dst_rows, 0, out.shape[0], f"rows of field {f.name}")
        elif num_rows > out.shape[0]:
            raise ValueError(f"unpack_rows: num_rows = {num_rows} (without dst_rows) is more than the {out.shape[0]} "
                             f"rows of field {f.name}")
    for f, out in zip(layout.fields, outputs):
        if f.num_cols and out is not None:
            values = layout.view(records, f.name).view(out.dtype)
            if dst_rows is None:
                out[:num_rows].copy_(values)
            else:
                out[dst_rows] = values
