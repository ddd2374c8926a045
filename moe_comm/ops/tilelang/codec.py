"""Float conversions written with integer arithmetic on the bits, for targets without the narrow types.

TileLang's C target has no bf16 or FP8 type, so the CPU build stores those tensors as integers of the same
width (``storage``) and converts through fp32 here: ``decode`` is exact, ``encode`` rounds to nearest, ties
to even, as torch's casts do (NaN stays NaN; FP8 E4M3 saturates at its largest finite value, as CUDA's
``satfinite`` conversion does). Formulas after IEEE 754's binary layouts; the FP8 layouts are OCP's
(E4M3 "fn": no infinities, one NaN per sign).
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import tilelang.language as T

__all__ = ["Format", "FORMATS", "decode", "encode", "magnitude"]


class Format(NamedTuple):
    """A binary float format: exponent and mantissa bits, whether it has infinities (E4M3 "fn" has not),
    its largest finite value, and the integer dtype that holds its bits on targets without the type."""

    exponent: int
    mantissa: int
    ieee: bool
    max: float
    storage: str


FORMATS = {
    "bfloat16": Format(8, 7, True, 3.3895313892515355e38, "uint16"),
    "float16": Format(5, 10, True, 65504.0, "uint16"),
    "float8_e4m3": Format(4, 3, False, 448.0, "uint8"),
    "float8_e5m2": Format(5, 2, True, 57344.0, "uint8"),
}


def _bits(x):
    return T.reinterpret(T.cast(x, "float32"), "uint32")


def _float(bits):
    return T.reinterpret(T.cast(bits, "uint32"), "float32")


def magnitude(x):
    """|fp32 x| by clearing the sign bit (the C target has no fabs)."""
    return _float(_bits(x) & T.uint32(0x7FFFFFFF))


def decode(code, dtype: str):
    """fp32 value of the ``dtype`` float whose bits are the unsigned integer ``code``."""
    f = FORMATS[dtype]
    b = T.cast(code, "uint32")
    width = 1 + f.exponent + f.mantissa
    sign = (b >> T.uint32(width - 1)) << T.uint32(31)
    bias = (1 << (f.exponent - 1)) - 1
    exponent = (b >> T.uint32(f.mantissa)) & T.uint32((1 << f.exponent) - 1)
    mantissa = b & T.uint32((1 << f.mantissa) - 1)
    if dtype == "bfloat16":  # the top half of an fp32
        return _float(b << T.uint32(16))
    normal = ((exponent + T.uint32(127 - bias)) << T.uint32(23)) | (mantissa << T.uint32(23 - f.mantissa))
    # Subnormals: mantissa * 2^(1 - bias - mantissa bits), scaled on the fp32 exponent field (exact; a float
    # constant would not be: the C code generator prints constants to 7 digits).
    scaled = _bits(T.cast(mantissa, "float32")) - T.uint32((bias + f.mantissa - 1) << 23)
    subnormal = T.if_then_else(mantissa == T.uint32(0), T.uint32(0), scaled)
    top = T.uint32((1 << f.exponent) - 1)
    if f.ieee:
        special = T.uint32(0x7F800000) | (mantissa << T.uint32(23 - f.mantissa))
        is_special = exponent == top
    else:
        special = T.uint32(0x7FC00000)
        is_special = (exponent == top) & (mantissa == T.uint32((1 << f.mantissa) - 1))
    magnitude = T.if_then_else(is_special, special, T.if_then_else(exponent == T.uint32(0), subnormal, normal))
    return _float(magnitude | sign)


def encode(value, dtype: str):
    """Bits (``FORMATS[dtype].storage``) of fp32 ``value`` rounded to ``dtype``: to nearest, ties to even."""
    f = FORMATS[dtype]
    bits = _bits(value)
    width = 1 + f.exponent + f.mantissa
    sign = (bits >> T.uint32(31)) << T.uint32(width - 1)
    if dtype == "bfloat16":  # same exponent range as fp32: round the low 16 bits away
        rounded = (bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))) >> T.uint32(16)
        code = T.if_then_else(T.isnan(value), sign | T.uint32(0x7FC0), rounded)
        return T.cast(code, f.storage)
    drop = 23 - f.mantissa
    bias = (1 << (f.exponent - 1)) - 1
    magnitude_bits = bits & T.uint32(0x7FFFFFFF)
    if not f.ieee:  # saturate (E4M3 has no infinity)
        magnitude_bits = T.min(magnitude_bits, T.uint32(struct.unpack("<I", struct.pack("<f", f.max))[0]))
    # Normal range: round the dropped bits to nearest even (a carry moves into the exponent), then rebias.
    rounded = (magnitude_bits + T.uint32((1 << (drop - 1)) - 1) + ((magnitude_bits >> T.uint32(drop)) & T.uint32(1))) \
        >> T.uint32(drop)
    normal = rounded - T.uint32((127 - bias) << f.mantissa)
    # Below the smallest normal the grid is uniform, 2^(1 - bias - mantissa bits) apart: the code is the
    # value's 24-bit significand shifted right onto that grid, rounded to nearest even (a count of
    # 2^mantissa is the smallest normal's code). Integer shifts, as C's float rounding functions differ.
    significand = (magnitude_bits & T.uint32(0x7FFFFF)) | T.uint32(0x800000)
    shift = T.min(T.uint32(151 - bias - f.mantissa) - (magnitude_bits >> T.uint32(23)), T.uint32(31))
    subnormal = (significand + (T.uint32(1) << (shift - T.uint32(1))) - T.uint32(1)
                 + ((significand >> shift) & T.uint32(1))) >> shift
    small = magnitude_bits < T.uint32((127 - bias + 1) << 23)
    code = T.if_then_else(small, subnormal, normal)
    if f.ieee:
        infinity = T.uint32(((1 << f.exponent) - 1) << f.mantissa)
        code = T.min(code, infinity)
        nan = infinity | T.uint32(1 << (f.mantissa - 1))
    else:
        nan = T.uint32((1 << (width - 1)) - 1)
    code = T.if_then_else(T.isnan(value), nan, code) | sign
    return T.cast(code, f.storage)
