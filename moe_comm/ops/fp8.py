"""Per-token FP8 E4M3 casts with one scale per 128 channels: DeepEP's low-latency formulas, bit-exact.

DeepEP's kernel (and so this module) computes, per token and 128-channel group g, in fp32:

    amax      = max(1e-4, max |x_g|)
    scale_inv = amax * (1 / 448)                 scale = 448 / amax              (default)
    scale_inv = 2^e, scale = 2^-e, e = ceil(log2(amax * (1 / 448)))              (round_scale)
    x_fp8     = e4m3(x_g * scale)   (round to nearest even; |x_g * scale| <= 448, so no saturation)

and returns ``scale_inv`` (the factor that dequantizes) as the scale. UE8M0 stores only the
exponent byte of the power-of-two ``scale_inv``, four groups packed little-endian per int32.
These functions are the plain-torch statement of those formulas (``quantize_reference`` uses them).
The low-latency dispatch casts with ``ops.quantize`` (the C++ kernel on CPU, Triton elsewhere), which
matches them bit for bit (``tests/ops/test_fused_ops.py``, ``test_ops.py``).
"""
from __future__ import annotations

import torch

__all__ = ["GROUP", "AMAX_FLOOR", "FP8_DTYPE", "per_token_cast_to_fp8", "per_token_cast_back", "per_block_cast_to_fp8",
           "ue8m0_to_float"]

#: Channels per FP8 scale, and the smallest amax a scale is computed from (an all-zero group gets a finite
#: scale); the kernels' values are csrc/common/codes.h's kFp8Group and kAmaxFloor (a test checks them).
GROUP = 128
AMAX_FLOOR = 1e-4
FP8_DTYPE = torch.float8_e4m3fn
_AMAX_FLOOR = torch.tensor(AMAX_FLOOR, dtype=torch.float32)
_MANTISSA = (1 << 23) - 1


def _fp8_max(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, 1 / max) in fp32. The kernel's constant is the fp32 quotient 1 / 448.0f; computing it in
    fp32 keeps it bit-identical (a Python float would be the double quotient, rounded once more)."""
    q_max = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)
    return q_max, torch.tensor(1.0, dtype=torch.float32) / q_max


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False,
                          dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts ``x`` `[T, H]` (bf16, fp16 or fp32; H a multiple of 128) to FP8 ``dtype`` (E4M3 by default,
    max 448; E5M2 has max 57344 in place of 448).

    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, scales)``: scales are float32 `[T, H / 128]` (``x ~ x_fp8 * scale``
        per group), or with ``use_ue8m0`` (needs ``round_scale`` and H a multiple of 512) int32
        `[T, H / 512]` holding 4 UE8M0 exponent bytes each, group 4i + j in byte j.
    """
    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ValueError(f"per_token_cast_to_fp8: x must be [T, H] with H a multiple of {GROUP}, got {list(x.shape)}")
    if use_ue8m0 and (not round_scale or x.shape[1] % (4 * GROUP)):
        raise ValueError(f"per_token_cast_to_fp8: use_ue8m0 needs round_scale=True and H a multiple of {4 * GROUP}, "
                         f"got round_scale={round_scale}, H={x.shape[1]}")
    num_tokens, hidden = x.shape
    groups = x.to(torch.float32).reshape(num_tokens, hidden // GROUP, GROUP)
    device = x.device
    q_max, q_max_inv = _fp8_max(dtype)
    amax = torch.maximum(groups.abs().amax(dim=2), _AMAX_FLOOR.to(device))
    if round_scale:
        bits = (amax * q_max_inv.to(device)).view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & _MANTISSA) != 0).to(torch.int32)
        scale = ((127 - exponent) << 23).view(torch.float32)
        scale_inv = ((127 + exponent) << 23).view(torch.float32)
    else:
        scale = q_max.to(device) / amax
        scale_inv = amax * q_max_inv.to(device)
    x_fp8 = (groups * scale.unsqueeze(2)).to(dtype).view(num_tokens, hidden)
    if use_ue8m0:
        exponent_bytes = (scale_inv.view(torch.int32) >> 23).to(torch.uint8)
        return x_fp8, exponent_bytes.view(torch.int32)
    return x_fp8, scale_inv


def ue8m0_to_float(packed: torch.Tensor) -> torch.Tensor:
    """Unpacks int32 `[..., G / 4]` UE8M0 scales into float32 `[..., G]` (2^(byte - 127))."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=packed.device)
    exponent_bytes = (packed.unsqueeze(-1) >> shifts) & 0xFF  # byte j of each int32, any strides
    return (exponent_bytes << 23).view(torch.float32).flatten(-2)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                        ) -> torch.Tensor:
    """Dequantizes ``x_fp8`` `[T, H]` with float32 `[T, H / 128]` or packed UE8M0 int32 `[T, H / 512]`
    scales (any strides): the fp32 product ``x_fp8 * scale``, rounded to ``dtype`` `[T, H]` (bf16 by
    default, as DeepEP's tests do)."""
    num_tokens, hidden = x_fp8.shape
    if scales.dtype == torch.int32:
        scales = ue8m0_to_float(scales)
    groups = x_fp8.to(torch.float32).view(num_tokens, hidden // GROUP, GROUP)
    return (groups * scales.unsqueeze(2)).view(num_tokens, hidden).to(dtype)


def per_block_cast_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts weights ``w`` `[E, N, K]` (K a multiple of 128, any N) to E4M3 with one fp32 dequantization
    scale per 128x128 block, DeepSeek-V3's checkpoint format (the last block of rows may be partial):
    ``(w_fp8 [E, N, K] float8_e4m3fn, scales [E, ceil(N / 128), K / 128] float32)``, with
    ``w ~ w_fp8 * scales[e, n // 128, k // 128]`` and the same fp32 formulas as ``per_token_cast_to_fp8``."""
    if w.dim() != 3 or w.shape[2] % GROUP:
        raise ValueError(f"per_block_cast_to_fp8: w must be [E, N, K] with K a multiple of {GROUP}, got {list(w.shape)}")
    experts, n, k = w.shape
    row_blocks = -(-n // GROUP)
    padded = torch.zeros(experts, row_blocks * GROUP, k, dtype=torch.float32, device=w.device)
    padded[:, :n] = w
    blocks = padded.view(experts, row_blocks, GROUP, k // GROUP, GROUP)
    q_max, q_max_inv = _fp8_max(FP8_DTYPE)
    amax = torch.maximum(blocks.abs().amax(dim=(2, 4)), _AMAX_FLOOR.to(w.device))
    scale = (q_max.to(w.device) / amax)[:, :, None, :, None]
    w_fp8 = (blocks * scale).to(FP8_DTYPE).view(experts, row_blocks * GROUP, k)[:, :n].contiguous()
    return w_fp8, amax * q_max_inv.to(w.device)
