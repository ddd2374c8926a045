"""LogFMT-10, DeepEP's 10-bit combine format (``low_latency_combine(..., use_logfmt=True)``): typed wrappers of
the native codec and its plain-torch reference.

A row of ``hidden`` bf16 channels (a positive multiple of 128) is encoded as, in order:

* metadata: per 128-channel division ``d``, the bf16 bits of ``amax = max |x|`` at byte ``4d`` and of
  ``amin = min |x|`` at ``4d + 2`` (little-endian; amax propagates NaN);
* chunks of ``W`` channels (``W = 1024`` when ``hidden % 1024 == 0``, else 512; the last chunk may be
  shorter), each raw (bf16, ``2n`` bytes) or, when every division of the chunk has ``0 < amax < 1`` and
  ``amin < amax`` in log terms, cast: ``n / 16`` blocks of 20 bytes, channel ``j`` of a block coded in 9
  bits at bit ``9j`` of the block's 160-bit little-endian string and its sign at bit ``144 + j``.

A row takes at most ``logfmt_row_bytes(hidden) = 2 * hidden + 4 * hidden / 128`` bytes; the encoders zero
the rest. Codes, decoded values and the decision rule are DeepEP's formula with one deviation: log2 and
exp2 are ``log2_reference`` / ``exp2_reference`` (IEEE fp32 operations, the same bits on every device),
not the GPU's MUFU approximations. ``csrc/common/logfmt.h`` states the formula and every difference
from DeepEP; this module reads all of its constants through ``moe_comm._C``.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from ..core.checks import describe
from ..core.errors import bad_argument
from ..core.native import cpu_threads, native

__all__ = ["logfmt_row_bytes", "logfmt_encode", "logfmt_decode", "logfmt_encode_reference",
           "logfmt_decode_reference", "log2_reference", "exp2_reference"]


@functools.lru_cache(maxsize=None)
def _k() -> dict[str, Any]:
    """The constants of ``csrc/common/logfmt.h`` (the one source)."""
    return dict(native().logfmt_constants())


def _check_hidden(op: str, name: str, hidden: Any) -> int:
    group = _k()["group"]
    if isinstance(hidden, bool) or not isinstance(hidden, int):
        bad_argument(op, name, f"a positive multiple of {group}", describe(hidden), kind=TypeError)
    if hidden <= 0 or hidden % group:
        bad_argument(op, name, f"a positive multiple of {group}", hidden)
    return hidden


def logfmt_row_bytes(hidden: int) -> int:
    """Bytes of one LogFMT row slot for ``hidden`` channels: ``2 * hidden + 4 * hidden / 128`` (every chunk
    raw; cast chunks take 10 bits a channel instead of 16). ValueError unless hidden is a positive multiple of 128."""
    return native().logfmt_row_bytes(_check_hidden("logfmt_row_bytes", "hidden", hidden))


def _check_rows(op: str, name: str, t: Any, cols: int, dtype: torch.dtype, rows: Optional[int] = None) -> None:
    """``t`` is a 2-D ``dtype`` tensor with ``cols`` columns, each row contiguous (any row stride)."""
    want = f"[{'N' if rows is None else rows}, {cols}] {str(dtype).replace('torch.', '')} with contiguous rows"
    if not isinstance(t, torch.Tensor):
        bad_argument(op, name, want, describe(t), kind=TypeError)
    if t.dtype != dtype:
        bad_argument(op, name, want, describe(t), kind=TypeError)
    if (t.dim() != 2 or t.shape[1] != cols or (rows is not None and t.shape[0] != rows)
            or (t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) < cols)):
        bad_argument(op, name, want, f"{describe(t)} strides {t.stride() if t.dim() else ()}")


def logfmt_encode(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Encodes bf16 rows as LogFMT-10. Local; CPU: native, blocking; other devices: the reference.

    Args:
        x: `[num_rows, hidden]` bfloat16, hidden a positive multiple of 128, each row contiguous.
        out: optional `[num_rows, logfmt_row_bytes(hidden)]` uint8 on x's device, each row contiguous (any
            row stride: e.g. a record field), written in place.
    Returns:
        `[num_rows, logfmt_row_bytes(hidden)]` uint8 (``out`` when given): row r encodes x[r] (the module
        docstring's format), bytes past its encoded length zero.
    Reference: ``logfmt_encode_reference`` (tests compare bitwise).
    """
    op = "logfmt_encode"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        bad_argument(op, "x", "a [num_rows, hidden] bfloat16 tensor", describe(x), kind=TypeError)
    hidden = _check_hidden(op, "x.shape[1] (hidden)", x.shape[1])
    _check_rows(op, "x", x, hidden, torch.bfloat16)
    row_bytes = native().logfmt_row_bytes(hidden)
    if out is None:
        out = torch.empty(x.shape[0], row_bytes, dtype=torch.uint8, device=x.device)
    _check_rows(op, "out", out, row_bytes, torch.uint8, x.shape[0])
    if out.device != x.device:
        bad_argument(op, "out", f"on {x.device} (the device of x)", describe(out))
    if not x.is_cpu:
        return out.copy_(logfmt_encode_reference(x))
    native().logfmt_encode_rows(out.data_ptr(), x.data_ptr(), x.shape[0], hidden, out.stride(0), x.stride(0),
                                cpu_threads())
    return out


def logfmt_decode(enc: torch.Tensor, hidden: int) -> torch.Tensor:
    """Decodes LogFMT-10 rows to float32. Local; CPU: native, blocking; other devices: the reference.

    Args:
        enc: `[num_rows, logfmt_row_bytes(hidden)]` uint8, each row contiguous (any row stride). Any bytes
            decode (to something) without a read outside the row.
        hidden: channels per row, a positive multiple of 128.
    Returns:
        `[num_rows, hidden]` float32: ``0 + decoded * 1`` per channel, exactly what the weighted combine adds
        for weight 1 (so a decoded -0 reads +0).
    Reference: ``logfmt_decode_reference`` (tests compare bitwise).
    """
    op = "logfmt_decode"
    hidden = _check_hidden(op, "hidden", hidden)
    _check_rows(op, "enc", enc, native().logfmt_row_bytes(hidden), torch.uint8)
    if not enc.is_cpu:
        return logfmt_decode_reference(enc, hidden)
    out = torch.empty(enc.shape[0], hidden, dtype=torch.float32)
    native().logfmt_decode_rows(out.data_ptr(), enc.data_ptr(), enc.shape[0], hidden, enc.stride(0), cpu_threads())
    return out


# ------------------------------------------------------------------------------------------- reference
def _as_float(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns -> float32."""
    return bits.to(torch.int32).view(torch.float32)


def _signed32(bits: int) -> int:
    """A 32-bit pattern as the int32 that has it."""
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _bf16_bits(bits: torch.Tensor) -> torch.Tensor:
    """Integer bf16 bit patterns in [0, 2^16) -> their float32 values (exact, NaN payloads kept)."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16).float()


def log2_reference(x: torch.Tensor) -> torch.Tensor:
    """log2 of float32 ``x`` as ``logfmt::log2`` computes it, bit for bit (every operation one IEEE fp32
    rounding): x = 2^e (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)], s = f / (2 + f), z = s^2,
    ln(1 + f) = (f - f^2/2) + s (f^2/2 + z (L1 + ... + L5 z^4)) with the first part split hi + lo, times
    1/ln2 split hi + lo, plus e. -Inf at +-0, Inf at Inf, NaN kept, the canonical NaN below 0."""
    k = _k()
    bits = x.view(torch.int32)
    subnormal = (bits & 0x7FFFFFFF) < 0x00800000
    b = torch.where(subnormal, x * 8388608.0, x).view(torch.int32)  # * 2^23, exact
    mant = (b & 0x007FFFFF) | 0x3F800000
    e = ((b >> 23) & 0xFF) - torch.where(subnormal, 150, 127)
    high = mant > k["sqrt2_bits"]
    mant = torch.where(high, mant - 0x00800000, mant)
    e = e + high.to(torch.int32)
    f = mant.view(torch.float32) - 1.0
    s = f / (f + 2.0)
    z = s * s
    coefs = k["log2_coefficients"]
    big_r = torch.full_like(z, coefs[-1])
    for coef in reversed(coefs[:-1]):
        big_r = big_r * z + coef
    big_r = big_r * z
    hfsq = (f * 0.5) * f
    r = s * (hfsq + big_r)
    hi = ((f - hfsq).view(torch.int32) & _signed32(k["hi_mask"])).view(torch.float32)
    lo = ((f - hi) - hfsq) + r
    v_hi = hi * k["inv_ln2_hi"]
    v_lo = (lo + hi) * k["inv_ln2_lo"] + lo * k["inv_ln2_hi"]
    kf = e.to(torch.float32)
    w = kf + v_hi
    v_lo = v_lo + ((kf - w) + v_hi)
    result = v_lo + w
    inf = torch.tensor(float("inf"), dtype=torch.float32)
    result = torch.where(x != x, x, result)
    result = torch.where(x < 0, _as_float(torch.tensor(0x7FC00000)), result)
    result = torch.where(x == inf, inf, result)
    return torch.where(x == 0, -inf, result)


def exp2_reference(y: torch.Tensor) -> torch.Tensor:
    """2^y of float32 ``y`` as ``logfmt::exp2`` computes it, bit for bit: n = y rounded to an integer
    (nearest even), 2^(y - n) by its degree-7 Taylor series in Horner form, times 2^(n/2) and 2^(n - n/2)
    (the last multiply rounds once). NaN kept; |y| clamped to 250 first (0 or Inf there anyway)."""
    k = _k()
    lim, magic = k["exp2_clamp"], k["round_magic"]
    c = torch.where(y > -lim, y, -lim)
    c = torch.where(c < lim, c, lim)
    n = (c + magic) - magic
    r = c - n
    coefs = k["exp2_coefficients"]
    q = torch.full_like(r, coefs[6])
    for coef in reversed(coefs[:6]):
        q = q * r + coef
    p = q * r + 1.0
    ni = n.to(torch.int32)
    na = torch.div(ni, 2, rounding_mode="trunc")
    v = (p * ((na + 127) << 23).view(torch.float32)) * ((ni - na + 127) << 23).view(torch.float32)
    return torch.where(y != y, y, v)


def _divisions(amax: torch.Tensor, amin: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per division (float32 amax and amin, any shape): ``logfmt::division``'s fields."""
    k = _k()
    log_amax = log2_reference(amax)
    floor_log = log_amax + (-k["min_clip"])
    raw = log2_reference(amin)
    log_amin = torch.where(raw > floor_log, raw, floor_log)
    step = (log_amax - log_amin) / k["num_steps"]
    step_inv = torch.ones_like(step) / step
    midpoint = log2_reference((1.0 + exp2_reference(step)) * 0.5)
    rounding = 2.0 - midpoint * step_inv
    return {"log_amin": log_amin, "step": step, "step_inv": step_inv, "fused": rounding - log_amin * step_inv,
            "cast": (log_amax < 0) & (log_amin < log_amax)}


def _chunks(hidden: int) -> list[tuple[int, int]]:
    """(first channel, channels) of every chunk."""
    k = _k()
    w = k["wide_chunk"] if hidden % k["wide_chunk"] == 0 else k["narrow_chunk"]
    return [(begin, min(w, hidden - begin)) for begin in range(0, hidden, w)]


def _plan(divs: dict[str, torch.Tensor], hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and chunk: whether it is cast (the AND of its divisions) and its payload's byte offset."""
    k = _k()
    g, chunks = k["group"], _chunks(hidden)
    cast = torch.stack([divs["cast"][:, b // g:(b + n) // g].all(dim=1) for b, n in chunks], dim=1)
    sizes = torch.stack([torch.where(cast[:, i], n // k["block"] * k["block_bytes"], 2 * n)
                         for i, (_, n) in enumerate(chunks)], dim=1)
    offsets = hidden // g * k["meta_bytes"] + sizes.cumsum(dim=1) - sizes
    return cast, offsets


def _per_channel(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(_k()["group"], dim=1)


def _little_endian(words: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """int64 [..., n] -> uint8 [..., n * num_bytes], least significant byte first."""
    shifts = torch.arange(num_bytes, dtype=torch.int64) * 8
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).flatten(-2)


def logfmt_encode_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of ``logfmt_encode`` (the module docstring's format; the formula of
    ``csrc/common/logfmt.h``): `[N, hidden]` bf16 -> `[N, logfmt_row_bytes(hidden)]` uint8."""
    k = _k()
    device, x = x.device, x.cpu().contiguous()
    num_rows, hidden = x.shape
    g, block = k["group"], k["block"]
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    mag, sign = bits & 0x7FFF, bits >> 15
    divs_mag = mag.view(num_rows, hidden // g, g)
    amax, amin = divs_mag.amax(dim=2), divs_mag.amin(dim=2)
    out = torch.zeros(num_rows, 2 * hidden + hidden // g * k["meta_bytes"], dtype=torch.uint8)
    out[:, :hidden // g * k["meta_bytes"]] = _little_endian(amax.long() | (amin.long() << 16), k["meta_bytes"])
    divs = _divisions(_bf16_bits(amax), _bf16_bits(amin))
    cast, offsets = _plan(divs, hidden)
    t = log2_reference(_bf16_bits(mag)) * _per_channel(divs["step_inv"]) + _per_channel(divs["fused"])
    t = torch.where(t > 0, t, 0.0)
    codes = torch.where(t < k["max_code"], t, float(k["max_code"])).to(torch.int64)  # floor: t >= 0
    # a block's 160 bits: channel j's 9 code bits at 9j, its sign at 144 + j, then 8 bits a byte, LSB first
    code_bits = (codes.view(num_rows, hidden // block, block, 1) >> torch.arange(k["code_bits"])) & 1
    block_bits = torch.cat([code_bits.flatten(2), sign.view(num_rows, hidden // block, block).long()], dim=2)
    packed = block_bits.view(num_rows, hidden // block, k["block_bytes"], 8) << torch.arange(8)
    packed = packed.sum(dim=3).to(torch.uint8).flatten(1)
    raw = x.view(torch.uint8)
    rows = torch.arange(num_rows).view(-1, 1)
    for i, (begin, n) in enumerate(_chunks(hidden)):
        cast_len = n // block * k["block_bytes"]
        cast_part = packed[:, begin // block * k["block_bytes"]:][:, :cast_len]
        for sel, part in ((cast[:, i], cast_part), (~cast[:, i], raw[:, 2 * begin:2 * (begin + n)])):
            cols = offsets[sel, i:i + 1] + torch.arange(part.shape[1])
            out[rows[sel], cols] = part[sel]
    return out.to(device)


def logfmt_decode_reference(enc: torch.Tensor, hidden: int) -> torch.Tensor:
    """Plain-torch specification of ``logfmt_decode``: `[N, logfmt_row_bytes(hidden)]` uint8 -> `[N, hidden]`
    float32, ``0 + value * 1`` with value = 0 for code 0, else ``+-exp2((code - 1) * step + log_amin)``,
    or the raw chunk's bf16."""
    k = _k()
    device, enc = enc.device, enc.cpu().long()
    num_rows = enc.shape[0]
    g, block, bb = k["group"], k["block"], k["block_bytes"]
    meta = enc[:, :hidden // g * k["meta_bytes"]].view(num_rows, hidden // g, 4)
    divs = _divisions(_bf16_bits(meta[..., 0] | (meta[..., 1] << 8)), _bf16_bits(meta[..., 2] | (meta[..., 3] << 8)))
    cast, offsets = _plan(divs, hidden)
    rows = torch.arange(num_rows).view(-1, 1)
    values = torch.empty(num_rows, hidden, dtype=torch.float32)
    log_amin, step = _per_channel(divs["log_amin"]), _per_channel(divs["step"])
    for i, (begin, n) in enumerate(_chunks(hidden)):
        packed = enc[rows, offsets[:, i:i + 1] + torch.arange(n // block * bb)].view(num_rows, n // block, bb)
        bits = ((packed.unsqueeze(-1) >> torch.arange(8)) & 1).flatten(2)  # [N, blocks, 160]
        codes = (bits[..., :block * k["code_bits"]].view(num_rows, n // block, block, k["code_bits"])
                 << torch.arange(k["code_bits"])).sum(dim=3).flatten(1)
        signs = bits[..., block * k["code_bits"]:].flatten(1) != 0
        span = slice(begin, begin + n)
        mag = exp2_reference((codes.to(torch.float32) - 1.0) * step[:, span] + log_amin[:, span])
        mag = torch.where(codes == 0, 0.0, mag)
        decoded = torch.where(signs, -mag, mag)
        raw = enc[rows, offsets[:, i:i + 1] + torch.arange(2 * n)].view(num_rows, n, 2)
        raw = _bf16_bits(raw[..., 0] | (raw[..., 1] << 8))
        values[:, span] = torch.where(cast[:, i:i + 1], decoded, raw)
    return (torch.zeros_like(values) + values * 1.0).to(device)
