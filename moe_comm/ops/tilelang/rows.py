"""Row gathers with an optional FP8 cast (``permute``'s copy, ``quantize``) and the FP8 dequantization.

The FP8 formulas are DeepEP's (``moe_comm/ops/fp8.py``): per row and 128-channel group, in fp32,
``amax = max(floor, max |x|)``, ``scale = q_max / amax`` (or, with ``round_scale``, the power of two of
``ceil(log2(amax / q_max))`` built on the exponent bits), codes ``x * scale`` rounded to nearest even, and the
dequantization factor ``1 / scale`` kept per group (fp32, or its UE8M0 exponent byte). fp32 constants that
are not exact in 7 digits (``1 / q_max``, the floor) come in as arguments: TileLang's C code generator prints
float constants to 7 digits.
"""
from typing import Optional

import tilelang.language as T

from .dialect import Dialect

__all__ = ["GROUP", "rows_program", "dequant_program"]

GROUP = 128  # ops.fp8.GROUP (these modules import no torch, so they keep their own copy; a test checks it)
_MANTISSA = (1 << 23) - 1


def rows_program(d: Dialect, hidden: int, dtype: str, code: Optional[str], round_scale: bool, ue8m0: bool):
    """Output row r = ``x[source[r] // source_div]`` (a negative source gives a zero row), cast to ``code``
    (an FP8 name, or None to copy the bits) with scales ``[rows, hidden / 128]`` (fp32, or UE8M0 bytes).
    One tile program per (128-channel group, row)."""
    rows_in, rows_out = T.dynamic("rows_in"), T.dynamic("rows_out")
    groups = -(-hidden // GROUP)
    out_dtype = code or dtype
    scale_dtype = "uint8" if ue8m0 else "float32"

    @T.prim_func
    def rows(x: T.Tensor((rows_in, hidden), d.storage(dtype)), source: T.Tensor((rows_out,), "int64"),
             out: T.Tensor((rows_out, hidden), d.storage(out_dtype)),
             scales: T.Tensor((rows_out, groups), scale_dtype), source_div: T.int64, amax_floor: T.float32,
             q_max: T.float32, q_max_inv: T.float32):
        with d.kernel(groups, rows_out) as (g, r):
            if code is None:
                for c in d.parallel(GROUP):
                    if g * GROUP + c < hidden:
                        out[r, g * GROUP + c] = T.if_then_else(
                            source[r] >= 0, x[T.max(source[r], 0) // source_div, g * GROUP + c],
                            T.cast(0, d.storage(dtype)))
            else:
                values = d.accumulator((GROUP,))
                amax = d.accumulator((1,))
                for c in d.parallel(GROUP):
                    values[c] = T.if_then_else(source[r] >= 0,
                                               d.load(x[T.max(source[r], 0) // source_div, g * GROUP + c], dtype),
                                               T.float32(0))
                d.absmax(values, amax)
                scale = T.alloc_var("float32")
                scale_inv = T.alloc_var("float32")
                if round_scale:
                    bits = T.reinterpret(T.max(amax[0], amax_floor) * q_max_inv, "uint32")
                    exponent = T.cast((bits >> T.uint32(23)) & T.uint32(0xFF), "int32") - 127 + T.cast(
                        (bits & T.uint32(_MANTISSA)) != T.uint32(0), "int32")
                    scale = T.reinterpret(T.cast((127 - exponent) << 23, "uint32"), "float32")
                    scale_inv = T.reinterpret(T.cast((127 + exponent) << 23, "uint32"), "float32")
                else:
                    scale = q_max / T.max(amax[0], amax_floor)
                    scale_inv = T.max(amax[0], amax_floor) * q_max_inv
                for c in d.parallel(GROUP):
                    out[r, g * GROUP + c] = d.store(values[c] * scale, code)
                if ue8m0:
                    scales[r, g] = T.cast(T.reinterpret(scale_inv, "uint32") >> T.uint32(23), "uint8")
                else:
                    scales[r, g] = scale_inv

    return rows


def dequant_program(d: Dialect, hidden: int, code: str, dtype: str, ue8m0: bool):
    """``out[r] = q[r] * scale`` of its 128-channel group, in fp32, rounded to ``dtype``."""
    rows_n = T.dynamic("rows")
    groups = hidden // GROUP
    scale_dtype = "uint8" if ue8m0 else "float32"

    @T.prim_func
    def dequant(q: T.Tensor((rows_n, hidden), d.storage(code)), scales: T.Tensor((rows_n, groups), scale_dtype),
                out: T.Tensor((rows_n, hidden), d.storage(dtype))):
        with d.kernel(groups, rows_n) as (g, r):
            for c in d.parallel(GROUP):
                if ue8m0:  # the exponent byte is the scale's fp32 exponent field
                    scale = T.reinterpret(T.cast(scales[r, g], "uint32") << T.uint32(23), "float32")
                    out[r, g * GROUP + c] = d.store(d.load(q[r, g * GROUP + c], code) * scale, dtype)
                else:
                    out[r, g * GROUP + c] = d.store(d.load(q[r, g * GROUP + c], code) * scales[r, g], dtype)

    return dequant
