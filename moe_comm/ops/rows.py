"""Row selection by index, and the checks every native kernel's Python wrapper runs on its indices.

The native kernels read memory at the indices they are given; these checks name the first bad
entry in the kernels' own words, before anything is read (the kernels check again themselves).
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from ..core.library import define, op
from ..core.native import cpu_threads, native

__all__ = ["take_rows", "take_rows_reference", "check_index", "check_on_cpu", "check_rows_index"]


def check_index(op: str, name: str, index: torch.Tensor, low: int, high: Union[int, torch.Tensor],
                where: Union[str, Callable[[tuple[int, ...]], str]]) -> None:
    """Raises ValueError unless every entry of ``index`` is in ``[low, high)``, naming the first bad one in the
    words of the native checks: ``"{op}: {name}[i, j] = v is outside [low, high) ({where})"``. ``high`` may be
    a tensor broadcast against ``index`` (a bound per column); ``where`` may be a function of the position.
    The plain-torch references run it before they index (one host sync on a device)."""
    if index.numel() == 0:
        return
    high_t = torch.as_tensor(high, device=index.device)
    bad = (index < low) | (index >= high_t)
    if not bool(bad.any()):
        return
    pos = tuple(int(p) for p in torch.nonzero(bad)[0])
    bound = int(high_t.expand(index.shape)[pos]) if high_t.dim() else int(high_t)
    text = where(pos) if callable(where) else where
    raise ValueError(f"{op}: {name}[{', '.join(map(str, pos))}] = {int(index[pos])} is outside [{low}, {bound}) "
                     f"({text})")


def check_on_cpu(op: str, tensors: dict[str, Optional[torch.Tensor]]) -> None:
    """Raises ValueError unless every tensor given is on the CPU: the native kernels dereference data_ptr()."""
    for name, t in tensors.items():
        if t is not None and not t.is_cpu:
            raise ValueError(f"{op}: {name} must be on the CPU like the others (the native path), got {t.device}")


def check_rows_index(op: str, name: str, rows: torch.Tensor, num_rows: int) -> None:
    """The native path reads ``rows[i]`` for i < num_rows as int64: it must be `[num_rows]` int64."""
    if rows.dim() != 1 or rows.shape[0] != num_rows or rows.dtype != torch.int64:
        raise ValueError(f"{op}: {name} must be [{num_rows}] int64, got {list(rows.shape)} {rows.dtype}")


def take_rows(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[i] = src[rows[i]]``, zeros where ``rows[i] == -1``: 2-D tensors of one element size, ``out`` with
    contiguous rows, ``src`` any strides, ``rows`` `[out.shape[0]]` int64 in [-1, src.shape[0]) (ValueError naming
    the entry otherwise). Local. (On CPU the native row copy, whose large copies bypass the cache;
    ``torch.index_select`` does not.)
    Reference: ``take_rows_reference``."""
    _check_take(out, src, rows)
    op("take_rows")(out, src, rows)


def _check_take(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    if out.device.type == "cpu":
        check_on_cpu("take_rows", {"src": src, "rows": rows})
    elif src.device != out.device or rows.device != out.device:
        raise ValueError(f"take_rows: src and rows must be on out's device {out.device}, got {src.device} and "
                         f"{rows.device}")
    if (out.dim() != 2 or src.dim() != 2 or out.shape[1] != src.shape[1] or out.element_size() != src.element_size()
            or rows.shape != (out.shape[0],) or out.stride(1) != 1):
        raise ValueError(f"take_rows: out {list(out.shape)} {out.dtype} (strides {out.stride()}), src "
                         f"{list(src.shape)} {src.dtype} and rows {list(rows.shape)} do not fit")


def _take_rows_fake(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    return None


@define("take_rows(Tensor(a!) out, Tensor src, Tensor rows) -> ()", _take_rows_fake)
def _take_rows_op(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    _check_take(out, src, rows)
    if out.device.type != "cpu":
        return take_rows_reference(out, src, rows)
    check_rows_index("take_rows", "rows", rows, out.shape[0])
    item = src.element_size()
    rows = rows.contiguous()
    segment = (src.data_ptr(), src.stride(0) * item, src.stride(1) * item, item, src.shape[1], 0, src.shape[0])
    # A one-row out may have any stride(0); its record is then its one row.
    record_bytes = (out.stride(0) if out.shape[0] > 1 else out.shape[1]) * item
    try:
        native().pack_rows(out.data_ptr(), [segment], rows.data_ptr(), rows.shape[0], record_bytes, cpu_threads())
    except ValueError as exc:  # worded for pack_rows, whose one segment here is src
        raise ValueError(str(exc).replace("pack_rows: src_rows", "take_rows: rows", 1)
                         .replace("rows of segment 0", "rows of src")) from None


def take_rows_reference(out: torch.Tensor, src: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain-torch specification of ``take_rows``; also the path for non-CPU devices."""
    check_index("take_rows", "rows", rows, -1, src.shape[0], "rows of src")
    out.copy_(src.index_select(0, rows.clamp(min=0)).view(out.dtype))
    out.view(torch.uint8)[rows < 0] = 0
