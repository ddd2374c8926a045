"""Float casts that round to nearest even identically on every Triton backend.

Backends disagree on casts: the CPU interpreter truncates fp32 -> bf16 and rounds FP8 half away
from zero, and vendors pick their own default cast modes. So a kernel first rounds its fp32 value
onto the target format's grid with integer and fp32 arithmetic (exact everywhere), and only then
converts: a value already on the grid converts without rounding on any backend.
"""
import triton
import triton.language as tl


@triton.jit
def round_to_grid(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """fp32 ``x`` rounded (to nearest, ties to even) to a float format with MANTISSA stored bits and
    smallest normal 2^MIN_EXPONENT, as an fp32 value. No saturation: the caller keeps |x| in range."""
    DROP: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
    normal = rounded.to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is uniform, 2^(MIN_EXPONENT - MANTISSA) apart: adding 1.5 * 2^23
    # of that step leaves exactly that step as the fp32 ulp, so the add itself rounds to nearest even.
    # On the magnitude, then signed, so a negative value that rounds to zero stays -0 as torch's casts give.
    # The sign goes back in as x's sign bit: Triton before 3.8 compiles a float `-m` as `0 - m`, +0 for m = 0.
    MAGIC: tl.constexpr = 1.5 * 2.0 ** (MIN_EXPONENT - MANTISSA + 23)
    magnitude = (tl.abs(x) + MAGIC) - MAGIC
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 2.0 ** MIN_EXPONENT, subnormal, normal)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """fp32 ``x`` converted to ``dtype`` with IEEE round-to-nearest-even on every backend."""
    if dtype == tl.bfloat16:
        return round_to_grid(x, 7, -126).to(dtype)
    elif dtype == tl.float16:
        return round_to_grid(x, 10, -14).to(dtype)
    elif dtype == tl.float8e4nv:
        return round_to_grid(x, 3, -6).to(dtype)
    elif dtype == tl.float8e5:
        return round_to_grid(x, 2, -14).to(dtype)
    else:
        return x.to(dtype)
