"""Per-token quantization: FP8 (E4M3 / E5M2) with one scale per 128 channels, and INT8 with one
scale per token (Ascend's dynamic quant). The ``_rows`` kernel also gathers rows, which is how
``permute`` fuses its copy with the cast. Formulas: ``moe_comm/ops/fp8.py`` and ``moe_comm/ops/quant.py``."""
import triton
import triton.language as tl

from .rounding import cast

# Quantization modes (the wrappers pass these numbers); kernels may read globals only as constexprs.
NONE = 0
FP8 = 1
INT8 = 2
GROUP = 128  # ops.fp8.GROUP (this module imports no torch, so it keeps its own copy; a test checks it)
_GROUP = tl.constexpr(GROUP)
_FP8 = tl.constexpr(FP8)
_INT8 = tl.constexpr(INT8)
_MANTISSA = tl.constexpr((1 << 23) - 1)


@triton.jit
def fp8_groups(x, amax_floor, q_max, q_max_inv, ROUND_SCALE: tl.constexpr):
    """128-channel groups ``x`` [G, 128] (fp32) -> (``x * scale`` [G, 128] fp32, ``scale_inv`` [G]): DeepEP's
    formulas, bit-identical to ``per_token_cast_to_fp8`` (IEEE division, exponent arithmetic on the bits).
    The division is on the [G] vector: triton-ascend's front end rejects a scalar ``div_rn``."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), amax_floor)
    if ROUND_SCALE:
        bits = (amax * q_max_inv).to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & _MANTISSA) != 0).to(tl.int32)
        scale = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
        scale_inv = ((127 + exponent) << 23).to(tl.float32, bitcast=True)
    else:
        scale = tl.math.div_rn(q_max + tl.zeros_like(amax), amax)
        scale_inv = amax * q_max_inv
    return x * scale[:, None], scale_inv


@triton.jit
def group_step(g0, groups, GROUPS: tl.constexpr):
    """One step over a row's 128-channel groups ``[g0, g0 + GROUPS)``: their ids [GROUPS], which exist
    (``ids < groups``), and their channel offsets [GROUPS, 128] in the row."""
    ids = g0 + tl.arange(0, GROUPS)
    return ids, ids < groups, ids[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]


@triton.jit
def round_int8(y):
    """Round half to even for |y| <= 127 without vendor intrinsics: adding 1.5 * 2^23 leaves no fraction
    bits, so the fp32 add rounds as IEEE does (launch with fp fusion off, or the add becomes an FMA)."""
    return ((y + 12582912.0) - 12582912.0).to(tl.int8)


@triton.jit
def rows_kernel(x_ptr, out_ptr, scales_ptr, source_ptr, hidden, source_div, amax_floor, q_max, q_max_inv,
                HAS_SOURCE: tl.constexpr, QUANT: tl.constexpr, ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr,
                BLOCK_H: tl.constexpr, GROUPS: tl.constexpr):
    """Output row ``r`` = input row ``source[r] // source_div`` (or ``r`` without a source; a negative
    source gives a zero row), optionally quantized. One program per output row.

    QUANT == FP8: ``out`` float8 [rows, H], ``scales`` fp32 [rows, H / 128] or, with UE8M0, the exponent
    bytes (uint8 view of int32 [rows, H / 512]); GROUPS groups of 128 channels per step.
    QUANT == INT8: ``out`` int8, ``scales`` fp32 [rows]: ``s = 127 / amax``, ``q = rne(x * s)``, scale ``1 / s``.
    """
    row = tl.program_id(0).to(tl.int64)
    src = row
    if HAS_SOURCE:
        src = tl.load(source_ptr + row)
    # A negative source reads no channel: bound the loads by in_hidden, not by `(src >= 0) & mask`, since
    # Triton 3.9's interpreter splats a scalar comparison to an int64 array, which its loads reject as a mask.
    in_hidden = tl.where(src >= 0, hidden, 0)
    in_row = x_ptr + (tl.maximum(src, 0) // source_div) * hidden
    out_row = out_ptr + row * hidden
    cols = tl.arange(0, BLOCK_H)
    if QUANT == _FP8:
        # GROUPS groups of 128 channels per step: independent reductions keep the memory system busy.
        groups = hidden // _GROUP
        in_groups = in_hidden // _GROUP
        for g0 in range(0, groups, GROUPS):
            ids, g_ok, offs = group_step(g0, groups, GROUPS)
            x = tl.load(in_row + offs, mask=(ids < in_groups)[:, None], other=0.0).to(tl.float32)
            scaled, scale_inv = fp8_groups(x, amax_floor, q_max, q_max_inv, ROUND_SCALE)
            tl.store(out_row + offs, cast(scaled, out_ptr.dtype.element_ty), mask=g_ok[:, None])
            if UE8M0:
                tl.store(scales_ptr + row * groups + ids,
                         ((scale_inv.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8), mask=g_ok)
            else:
                tl.store(scales_ptr + row * groups + ids, scale_inv, mask=g_ok)
    elif QUANT == _INT8:
        amax = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h in range(0, hidden, BLOCK_H):
            x = tl.load(in_row + h + cols, mask=h + cols < in_hidden, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scales = tl.math.div_rn(q_max, tl.maximum(amax, amax_floor))  # vector division, as in fp8_group
        scale = tl.min(scales, axis=0)
        for h in range(0, hidden, BLOCK_H):
            mask = h + cols < hidden
            x = tl.load(in_row + h + cols, mask=h + cols < in_hidden, other=0.0).to(tl.float32)
            tl.store(out_row + h + cols, round_int8(x * scale), mask=mask)
        tl.store(scales_ptr + row, tl.max(tl.math.div_rn(1.0, scales), axis=0))
    else:
        for h in range(0, hidden, BLOCK_H):
            mask = h + cols < hidden
            x = tl.load(in_row + h + cols, mask=h + cols < in_hidden, other=0.0)
            tl.store(out_row + h + cols, x, mask=mask)


@triton.jit
def dequant_kernel(q_ptr, scales_ptr, out_ptr, hidden, QUANT: tl.constexpr, UE8M0: tl.constexpr,
                   BLOCK_H: tl.constexpr, GROUPS: tl.constexpr):
    """``out[r] = q[r] * scale`` in fp32, rounded to out's dtype. FP8: one scale per 128 channels (fp32, or
    UE8M0 exponent bytes), GROUPS groups per step; INT8: one fp32 scale per row, BLOCK_H channels per step.
    One program per row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    if QUANT == _FP8:
        groups = hidden // _GROUP
        for g0 in range(0, groups, GROUPS):
            ids, g_ok, offs = group_step(g0, groups, GROUPS)
            if UE8M0:
                exponent = tl.load(scales_ptr + row * groups + ids, mask=g_ok, other=0).to(tl.int32)
                scale = (exponent << 23).to(tl.float32, bitcast=True)
            else:
                scale = tl.load(scales_ptr + row * groups + ids, mask=g_ok, other=0.0)
            q = tl.load(q_ptr + row * hidden + offs, mask=g_ok[:, None], other=0.0).to(tl.float32)
            tl.store(out_ptr + row * hidden + offs, cast(q * scale[:, None], out_ptr.dtype.element_ty),
                     mask=g_ok[:, None])
    else:
        scale = tl.load(scales_ptr + row)
        for h in range(0, hidden, BLOCK_H):
            mask = h + cols < hidden
            q = tl.load(q_ptr + row * hidden + h + cols, mask=mask, other=0).to(tl.float32)
            tl.store(out_ptr + row * hidden + h + cols, cast(q * scale, out_ptr.dtype.element_ty), mask=mask)
