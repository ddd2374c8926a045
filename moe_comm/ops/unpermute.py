"""Weighted unpermute-reduce: expert outputs back in token order, summed over top-k."""
from __future__ import annotations

from typing import Optional

import torch

from ..core.native import NATIVE_DTYPES
from .combine_reduce import combine_reduce
from ..core.library import define, op
from . import tilelang_launch
from .impl import kernels, next_pow2, renamed_impl, resolve
from .records import Field, RecordLayout

__all__ = ["unpermute_reduce", "unpermute_reduce_reference"]

_BLOCK_H = 1024


def _check(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"unpermute_reduce: y must be a 2-D tensor [rows, H], got "
                         f"{list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    if not isinstance(row_of, torch.Tensor) or row_of.dim() != 2 or row_of.dtype != torch.int64:
        raise ValueError(f"unpermute_reduce: row_of must be int64 [T, K], got "
                         f"{(row_of.dtype, list(row_of.shape)) if isinstance(row_of, torch.Tensor) else row_of!r}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != row_of.shape or \
            topk_weights.dtype != torch.float32:
        raise ValueError(f"unpermute_reduce: topk_weights must be float32 {list(row_of.shape)} (row_of's shape), got "
                         f"{(topk_weights.dtype, list(topk_weights.shape)) if isinstance(topk_weights, torch.Tensor) else topk_weights!r}")
    if row_of.device != y.device or topk_weights.device != y.device:
        raise ValueError(f"unpermute_reduce: row_of and topk_weights must be on y's device {y.device}, got "
                         f"{row_of.device} and {topk_weights.device}")


def _check_rows(y: torch.Tensor, row_of: torch.Tensor) -> None:
    if row_of.numel():
        low, high = int(row_of.min()), int(row_of.max())
        if low < -1 or high >= y.shape[0]:
            raise ValueError(f"unpermute_reduce: row_of entries must be -1 or in [0, {y.shape[0]}) (y's rows), "
                             f"got values in [{low}, {high}]")


def unpermute_reduce(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor, *,
                     out_dtype: Optional[torch.dtype] = None, impl: Optional[str] = None,
                     backend: Optional[str] = None) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * y[row_of[t, k]]`` over slots with ``row_of >= 0``, k ascending,
    in fp32, rounded to ``out_dtype`` (default y's): `[T, H]`. ``row_of`` is ``Permutation.row_of``. The fixed
    order makes results repeat bit for bit on a backend; backends may differ by fp32 rounding (FMA).
    Reference ``unpermute_reduce_reference`` (fp64)."""
    _check(y, row_of, topk_weights)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"unpermute_reduce: out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    return op("unpermute_reduce")(y, row_of, topk_weights, out_dtype or y.dtype,
                                  renamed_impl("unpermute_reduce", "impl", impl, backend))


def _unpermute_reduce_fake(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype,
                           impl: Optional[str]) -> torch.Tensor:
    return y.new_empty(row_of.shape[0], y.shape[-1], dtype=out_dtype)


@define("unpermute_reduce(Tensor y, Tensor row_of, Tensor topk_weights, ScalarType out_dtype, str? impl) -> Tensor",
        _unpermute_reduce_fake)
def _unpermute_reduce_op(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor, out_dtype: torch.dtype,
                         impl: Optional[str]) -> torch.Tensor:
    _check(y, row_of, topk_weights)
    if y.device.type == "cpu":  # elsewhere it would cost a host sync
        _check_rows(y, row_of)
    num_tokens, num_topk = row_of.shape
    chosen = resolve("unpermute_reduce", y.device, impl)
    if chosen == "tilelang":
        tilelang_launch.dtype_name("unpermute_reduce", y.dtype)
        tilelang_launch.dtype_name("unpermute_reduce", out_dtype)
        out = torch.empty(num_tokens, y.shape[1], dtype=out_dtype, device=y.device)
        if out.numel():
            tilelang_launch.unpermute(y, row_of, topk_weights, out)
        return out
    if chosen == "triton":
        out = torch.empty(num_tokens, y.shape[1], dtype=out_dtype, device=y.device)
        if out.numel():
            block = min(_BLOCK_H, next_pow2(y.shape[1]))
            kernels("unpermute").unpermute_reduce_kernel[(num_tokens, -(-y.shape[1] // block))](
                y.contiguous(), row_of.contiguous(), topk_weights.contiguous(), out, y.shape[1],
                NUM_TOPK=num_topk, BLOCK_H=block)
        return out
    if y.device.type == "cpu" and out_dtype == y.dtype and y.dtype in NATIVE_DTYPES:
        # The combine reduction with the top-k slots as its sources: row_of is its send_pos.
        out = torch.empty(num_tokens, y.shape[1], dtype=out_dtype)
        records = y.contiguous().view(torch.uint8).view(y.shape[0], y.shape[1] * y.element_size())
        layout = RecordLayout((Field("x", y.dtype, y.shape[1], 0),), records.shape[1])
        combine_reduce(layout, records, row_of.to(torch.int32), None, None, out, None, scale=topk_weights)
        return out
    acc = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(num_topk):
        rows = row_of[:, k]
        routed = torch.nonzero(rows >= 0).reshape(-1)
        acc.index_add_(0, routed, y[rows[routed]].to(torch.float32) * topk_weights[routed, k].unsqueeze(1))
    return acc.to(out_dtype)


def unpermute_reduce_reference(y: torch.Tensor, row_of: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """fp64 specification of ``unpermute_reduce`` (returns float64 `[T, H]`)."""
    _check_rows(y, row_of)
    out = torch.zeros(row_of.shape[0], y.shape[1], dtype=torch.float64, device=y.device)
    for t in range(row_of.shape[0]):
        for k in range(row_of.shape[1]):
            if row_of[t, k] >= 0:
                out[t] += topk_weights[t, k].double() * y[row_of[t, k]].double()
    return out
