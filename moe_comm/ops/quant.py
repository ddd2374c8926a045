"""Per-token quantization for the wire and the FP8 GEMMs, on any device.

Formats (``fmt``):
    ``e4m3`` / ``e5m2``  one fp32 scale per token and 128 channels, DeepEP's formulas (``fp8.py``), or
                         packed UE8M0 exponents with ``use_ue8m0``.
    ``int8``             one fp32 scale per token, Ascend's dynamic quant: ``s = 127 / max(amax, 1e-4)``,
                         ``q = round_half_even(x * s)``, scale ``1 / s`` (fp32 divisions, IEEE).
Every backend gives the same codes and scales bit for bit as ``quantize_reference``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..core.library import define, op
from ..core.native import NATIVE_DTYPES, cpu_threads, native, native_dtype, native_format
from . import tilelang_launch
from .fp8 import AMAX_FLOOR, GROUP, per_token_cast_back, per_token_cast_to_fp8
from .impl import kernels, next_pow2, renamed_impl, resolve, tilelang_covers

__all__ = ["FORMATS", "quantize", "quantize_reference", "dequantize", "dequantize_reference", "launch_rows",
           "native_rows", "check_quant_args", "scales_shape"]

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int8": torch.int8}
_INT8_MAX = torch.tensor(127.0, dtype=torch.float32)
_ROW_BLOCK = 1024   # channels per step of the rows kernels (unquantized and INT8)
_FP8_GROUPS = 8     # 128-channel groups per step of the FP8 rows kernels


def _blocks(hidden: int) -> dict[str, int]:
    """Block constexprs of the rows kernels for ``hidden`` channels."""
    return {"BLOCK_H": min(_ROW_BLOCK, next_pow2(hidden)), "GROUPS": min(_FP8_GROUPS, next_pow2(max(hidden // GROUP, 1)))}


def check_quant_args(op: str, hidden: int, fmt: Optional[str], round_scale: bool, use_ue8m0: bool) -> None:
    """Raises ValueError naming the argument when ``fmt``/``round_scale``/``use_ue8m0`` do not fit ``hidden``."""
    if fmt is None:
        return
    if fmt not in FORMATS:
        raise ValueError(f"{op}: fmt must be one of {sorted(FORMATS)} (or None), got {fmt!r}")
    if fmt == "int8":
        if round_scale or use_ue8m0:
            raise ValueError(f"{op}: round_scale and use_ue8m0 apply to FP8 only, got fmt='int8' with "
                             f"round_scale={round_scale}, use_ue8m0={use_ue8m0}")
        return
    if hidden % GROUP:
        raise ValueError(f"{op}: FP8 needs the hidden size to be a multiple of {GROUP}, got {hidden}")
    if use_ue8m0 and (not round_scale or hidden % (4 * GROUP)):
        raise ValueError(f"{op}: use_ue8m0 needs round_scale=True and a hidden size that is a multiple of "
                         f"{4 * GROUP}, got round_scale={round_scale}, hidden={hidden}")


def _check_x(op: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D tensor [T, H], got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")


def scales_shape(rows: int, hidden: int, fmt: str, use_ue8m0: bool) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the scales of ``rows`` tokens of ``hidden`` channels in ``fmt`` (``fp8`` for either FP8)."""
    if fmt == "int8":
        return (rows,), torch.float32
    if use_ue8m0:
        return (rows, hidden // (4 * GROUP)), torch.int32
    return (rows, hidden // GROUP), torch.float32


def _row_outputs(x: torch.Tensor, num_rows: int, fmt: Optional[str], use_ue8m0: bool
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    out = torch.empty(num_rows, x.shape[1], dtype=FORMATS[fmt] if fmt else x.dtype, device=x.device)
    if fmt is None:
        return out, None
    shape, dtype = scales_shape(num_rows, x.shape[1], fmt, use_ue8m0)
    return out, torch.empty(shape, dtype=dtype, device=x.device)


def native_rows(x: torch.Tensor, num_rows: int, fmt: str, round_scale: bool, use_ue8m0: bool,
                source: Optional[torch.Tensor] = None, source_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``launch_rows`` (with a format) for CPU tensors, in ``moe_comm._C``: the same rows, codes and scales as
    ``quantize_reference`` bit for bit, in one pass. ``source`` `[num_rows]` int64 entries must be -1 or below
    ``x.shape[0] * source_div`` (without ``source``, ``num_rows <= x.shape[0]``), else ValueError."""
    if source is not None and (source.dim() != 1 or source.shape[0] != num_rows or source.dtype != torch.int64):
        raise ValueError(f"quantize_rows: source must be [{num_rows}] int64, got {list(source.shape)} {source.dtype}")
    x = x.contiguous()
    out, scales = _row_outputs(x, num_rows, fmt, use_ue8m0)
    source = None if source is None else source.contiguous()
    if num_rows and x.shape[1]:
        native().quantize_rows(out.data_ptr(), scales.data_ptr(), x.data_ptr(),
                               0 if source is None else source.data_ptr(), num_rows, x.shape[0], x.shape[1],
                               source_div,
                               native_dtype(x.dtype), native_format(FORMATS[fmt]), round_scale, use_ue8m0, cpu_threads())
    return out, scales


def launch_rows(x: torch.Tensor, num_rows: int, fmt: Optional[str], round_scale: bool, use_ue8m0: bool,
                source: Optional[torch.Tensor] = None, source_div: int = 1
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Runs the Triton rows kernel: output row r is ``x[source[r] // source_div]`` (``x[r]`` without a
    source; zeros for a negative source), quantized to ``fmt`` when given. Returns (rows, scales or None)."""
    k = kernels("quant")
    hidden = x.shape[1]
    x = x.contiguous()
    out, scales = _row_outputs(x, num_rows, fmt, use_ue8m0)
    mode, q_max = k.NONE, 1.0
    if fmt is not None:
        mode = k.INT8 if fmt == "int8" else k.FP8
        q_max = 127.0 if fmt == "int8" else torch.finfo(FORMATS[fmt]).max
    if num_rows == 0 or hidden == 0:
        return out, scales
    q_max_inv = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(q_max, dtype=torch.float32))
    scales_arg = scales.view(torch.uint8) if use_ue8m0 else scales
    k.rows_kernel[(num_rows,)](x, out, scales_arg, source, hidden, source_div, AMAX_FLOOR, q_max, q_max_inv,
                               HAS_SOURCE=source is not None, QUANT=mode, ROUND_SCALE=round_scale,
                               UE8M0=use_ue8m0, enable_fp_fusion=False, **_blocks(hidden))
    return out, scales


def _check_tilelang_format(op: str, fmt: Optional[str]) -> None:
    """ValueError naming ``op`` when the TileLang programs have no cast to ``fmt`` (int8)."""
    if not tilelang_covers(op, fmt):
        raise ValueError(f"{op}: impl 'tilelang' has no {fmt} program (FP8 only); use impl 'native' or 'triton'")


def tilelang_rows(op: str, x: torch.Tensor, num_rows: int, fmt: Optional[str], round_scale: bool, use_ue8m0: bool,
                  source: Optional[torch.Tensor] = None, source_div: int = 1
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``launch_rows`` on the TileLang rows program (FP8 formats or none; ValueError naming ``op`` for int8)."""
    _check_tilelang_format(op, fmt)
    tilelang_launch.dtype_name(op, x.dtype)
    out, scales = _row_outputs(x, num_rows, fmt, use_ue8m0)
    if num_rows and x.shape[1]:
        if source is None:
            source = torch.arange(num_rows, dtype=torch.int64, device=x.device)
        tilelang_launch.rows(x, out, scales, source, source_div, FORMATS[fmt] if fmt else None, round_scale,
                             use_ue8m0)
    return out, scales


def quantize(x: torch.Tensor, fmt: str = "e4m3", *, round_scale: bool = False, use_ue8m0: bool = False,
             impl: Optional[str] = None, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` `[T, H]` (bf16, fp16 or fp32) per token.

    Returns:
        FP8: ``(q [T, H] float8_e4m3fn / float8_e5m2, scales)`` with fp32 scales `[T, H / 128]` (``x ~ q * scale``
        per group) or, with ``use_ue8m0`` (needs ``round_scale``), int32 `[T, H / 512]` of 4 exponent bytes.
        INT8: ``(q [T, H] int8, scales [T] fp32)``.
    Same bits on every backend; reference ``quantize_reference``.
    """
    _check_quantize(x, fmt, round_scale, use_ue8m0)
    return op("quantize")(x, fmt, round_scale, use_ue8m0, renamed_impl("quantize", "impl", impl, backend))


def _check_quantize(x: torch.Tensor, fmt: Optional[str], round_scale: bool, use_ue8m0: bool) -> None:
    _check_x("quantize", x)
    if fmt is None:
        raise ValueError(f"quantize: fmt must be one of {sorted(FORMATS)}, got None")
    check_quant_args("quantize", x.shape[1], fmt, round_scale, use_ue8m0)


def _quantize_fake(x: torch.Tensor, fmt: str, round_scale: bool, use_ue8m0: bool,
                   impl: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    shape, dtype = scales_shape(x.shape[0], x.shape[-1], fmt, use_ue8m0)
    return x.new_empty(x.shape, dtype=FORMATS.get(fmt, torch.int8)), x.new_empty(shape, dtype=dtype)


@define("quantize(Tensor x, str fmt, bool round_scale, bool use_ue8m0, str? impl) -> (Tensor, Tensor)",
        _quantize_fake)
def _quantize_op(x: torch.Tensor, fmt: str, round_scale: bool, use_ue8m0: bool,
                 impl: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    _check_quantize(x, fmt, round_scale, use_ue8m0)
    chosen = resolve("quantize", x.device, impl)
    if chosen == "triton":
        return launch_rows(x, x.shape[0], fmt, round_scale, use_ue8m0)
    if chosen == "tilelang":
        return tilelang_rows("quantize", x, x.shape[0], fmt, round_scale, use_ue8m0)
    if x.device.type == "cpu":
        return native_rows(x, x.shape[0], fmt, round_scale, use_ue8m0)
    return quantize_reference(x, fmt, round_scale=round_scale, use_ue8m0=use_ue8m0)


def quantize_reference(x: torch.Tensor, fmt: str = "e4m3", *, round_scale: bool = False, use_ue8m0: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of ``quantize``; also the native path off the CPU (vectorized torch)."""
    if fmt != "int8":
        return per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0, dtype=FORMATS[fmt])
    x32 = x.to(torch.float32)
    amax = torch.clamp_min(x32.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0], device=x.device),
                           AMAX_FLOOR)
    scale = _INT8_MAX.to(x.device) / amax
    q = torch.round(x32 * scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, torch.ones_like(scale) / scale


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
               impl: Optional[str] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``q * scale`` in fp32, rounded to ``dtype``: `[T, H]`. ``q`` FP8 with fp32 `[T, H / 128]` or UE8M0
    int32 `[T, H / 512]` scales, or int8 with fp32 `[T]` scales. Reference ``dequantize_reference``."""
    _check_dequantize(q, scales)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dequantize: dtype must be a torch.dtype, got {dtype!r}")
    return op("dequantize")(q, scales, dtype, renamed_impl("dequantize", "impl", impl, backend))


def _check_dequantize(q: torch.Tensor, scales: torch.Tensor) -> None:
    if q.dim() != 2 or q.dtype not in FORMATS.values():
        raise ValueError(f"dequantize: q must be [T, H] float8_e4m3fn, float8_e5m2 or int8, got "
                         f"{q.dtype} {list(q.shape)}")
    fmt = "int8" if q.dtype == torch.int8 else "fp8"
    use_ue8m0 = scales.dtype == torch.int32
    expected, _ = scales_shape(q.shape[0], q.shape[1], fmt, use_ue8m0)
    if tuple(scales.shape) != expected or scales.dtype not in (torch.float32, torch.int32) or \
            (fmt == "int8" and use_ue8m0):
        raise ValueError(f"dequantize: scales for {q.dtype} {list(q.shape)} must be float32 {list(expected)}"
                         f"{' (or UE8M0 int32)' if fmt == 'fp8' else ''}, got {scales.dtype} {list(scales.shape)}")
    if scales.device != q.device:
        raise ValueError(f"dequantize: scales must be on q's device {q.device}, got {scales.device}")


def _dequantize_fake(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, impl: Optional[str]) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=dtype)


@define("dequantize(Tensor q, Tensor scales, ScalarType dtype, str? impl) -> Tensor", _dequantize_fake)
def _dequantize_op(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, impl: Optional[str]) -> torch.Tensor:
    _check_dequantize(q, scales)
    fmt = "int8" if q.dtype == torch.int8 else "fp8"
    use_ue8m0 = scales.dtype == torch.int32
    chosen = resolve("dequantize", q.device, impl)
    if chosen == "tilelang":
        _check_tilelang_format("dequantize", fmt)
        tilelang_launch.dtype_name("dequantize", dtype)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        if q.numel():
            tilelang_launch.dequant(q, scales, out, use_ue8m0)
        return out
    if chosen != "triton":
        if q.device.type == "cpu" and dtype in NATIVE_DTYPES:
            return _native_dequantize(q, scales, dtype, fmt, use_ue8m0)
        return dequantize_reference(q, scales, dtype)
    k = kernels("quant")
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        scales = scales.contiguous()
        k.dequant_kernel[(q.shape[0],)](q.contiguous(), scales.view(torch.uint8) if use_ue8m0 else scales, out,
                                        q.shape[1], QUANT=k.INT8 if fmt == "int8" else k.FP8, UE8M0=use_ue8m0,
                                        **_blocks(q.shape[1]))
    return out


def _native_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, fmt: str, use_ue8m0: bool
                       ) -> torch.Tensor:
    """``dequantize`` on CPU tensors, in ``moe_comm._C``: ``dequantize_reference``'s bits."""
    q, scales = q.contiguous(), scales.contiguous()
    out = torch.empty(q.shape, dtype=dtype)
    if q.numel():
        native().dequantize_rows(out.data_ptr(), q.data_ptr(), scales.data_ptr(), q.shape[0], q.shape[1],
                                 native_dtype(dtype), native_format(q.dtype), use_ue8m0, cpu_threads())
    return out


def dequantize_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain-torch specification of ``dequantize``; also the native path off the CPU."""
    if q.dtype == torch.int8:
        return (q.to(torch.float32) * scales.unsqueeze(1)).to(dtype)
    return per_token_cast_back(q, scales, dtype)

