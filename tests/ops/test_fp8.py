"""``moe_comm.ops.per_token_cast_to_fp8`` against an independent NumPy transcription of DeepEP's
low-latency cast (fp32 IEEE arithmetic; E4M3 by nearest value, ties to even, from the code table)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_comm.ops import per_token_cast_back, per_token_cast_to_fp8, ue8m0_to_float

# The non-negative finite E4M3 values (codes 0x00-0x7E, ascending with the code); the sign is bit 7.
_TABLE_CODES = np.arange(0x7F, dtype=np.uint8)
_TABLE_VALUES = torch.from_numpy(_TABLE_CODES.copy()).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)


def _e4m3_codes(v: np.ndarray) -> np.ndarray:
    """Nearest E4M3 code of each float32 (ties to the even code, sign kept, so tiny negatives give
    -0), by search in the value table."""
    signed = v.reshape(-1).astype(np.float64)
    flat = np.abs(signed)
    hi = np.clip(np.searchsorted(_TABLE_VALUES, flat), 1, len(_TABLE_VALUES) - 1)
    lo = hi - 1
    d_lo, d_hi = flat - _TABLE_VALUES[lo], _TABLE_VALUES[hi] - flat
    tie = d_lo == d_hi
    pick = np.where(d_lo < d_hi, lo, hi)
    pick = np.where(tie, np.where(_TABLE_CODES[lo] % 2 == 0, lo, hi), pick)
    codes = _TABLE_CODES[pick] | np.where(np.signbit(signed), 0x80, 0x00)
    return codes.astype(np.uint8).reshape(v.shape)


def _deepep_cast(x: torch.Tensor, round_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 codes [T, H], scale_inv [T, H/128] float32) by DeepEP's formulas, in NumPy float32."""
    v = x.float().numpy().reshape(x.shape[0], -1, 128)
    amax = np.maximum(np.float32(1e-4), np.abs(v).max(axis=2))
    inv = np.float32(1.0) / np.float32(448.0)
    if round_scale:
        bits = (amax * inv).astype(np.float32).view(np.uint32)
        e = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
        scale = np.ldexp(np.float32(1.0), -e).astype(np.float32)
        scale_inv = np.ldexp(np.float32(1.0), e).astype(np.float32)
    else:
        scale_inv = (amax * inv).astype(np.float32)
        scale = (np.float32(448.0) / amax).astype(np.float32)
    scaled = (v * scale[:, :, None]).astype(np.float32)
    return _e4m3_codes(scaled).reshape(x.shape), scale_inv


def _inputs(seed: int, tokens: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** torch.randint(-6, 5, (tokens, hidden // 128, 1), generator=g).float()
    x = (torch.randn(tokens, hidden // 128, 128, generator=g) * mag).view(tokens, hidden)
    x[0] = 0                      # amax floor: all-zero groups
    x[1, :128] = 3e-5             # below the floor
    x[2, 128:256] = -448.0        # exact range edge
    x[3] = torch.linspace(-1, 1, hidden)
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("round_scale", [False, True])
@pytest.mark.parametrize("hidden", [128, 512, 1152, 7168])
def test_cast_matches_deepep_formula(round_scale, hidden):
    x = _inputs(hidden + round_scale, 9, hidden)
    q, scales = per_token_cast_to_fp8(x, round_scale=round_scale)
    codes, scale_inv = _deepep_cast(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    assert np.array_equal(scales.numpy().view(np.uint32), scale_inv.view(np.uint32))


@pytest.mark.parametrize("hidden", [512, 2048])
def test_ue8m0_packs_power_of_two_exponents(hidden):
    x = _inputs(hidden, 5, hidden)
    q, packed = per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    codes, scale_inv = _deepep_cast(x, True)
    assert packed.dtype == torch.int32 and packed.shape == (5, hidden // 512)
    assert np.array_equal(q.view(torch.uint8).numpy(), codes)
    exponent_bytes = (scale_inv.view(np.uint32) >> 23).astype(np.int64).reshape(5, -1, 4)
    words = (exponent_bytes << np.array([0, 8, 16, 24])).sum(axis=2)  # group 4i + j in byte j
    assert np.array_equal(packed.numpy().astype(np.int64) & 0xFFFFFFFF, words)
    assert torch.equal(ue8m0_to_float(packed), torch.from_numpy(scale_inv))
    assert torch.equal(ue8m0_to_float(packed.T.contiguous().T), torch.from_numpy(scale_inv))  # any strides


def test_cast_back_is_fp32_product_rounded_to_bf16():
    x = _inputs(0, 6, 256)
    q, scales = per_token_cast_to_fp8(x)
    back = per_token_cast_back(q, scales.T.contiguous().T)
    want = (q.float().view(6, 2, 128) * scales.view(6, 2, 1)).view(6, 256).to(torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), want.view(torch.int16))
    assert per_token_cast_back(q, scales, torch.float32).dtype == torch.float32


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"x must be \[T, H\] with H a multiple of 128, got \[2, 100\]"):
        per_token_cast_to_fp8(torch.zeros(2, 100))
    with pytest.raises(ValueError, match=r"use_ue8m0 needs round_scale=True and H a multiple of 512"):
        per_token_cast_to_fp8(torch.zeros(2, 256), round_scale=True, use_ue8m0=True)
