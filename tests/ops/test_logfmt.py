"""LogFMT-10 (DeepEP's 10-bit low-latency combine format): the native codec (csrc/common/logfmt.h through
moe_comm._C) against its torch reference bit for bit, the format by hand, the decision rule's granularity,
edge values, the weighted reduction over LogFMT rows, and DeepEP's accuracy bound on DeepEP's test inputs."""
from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from moe_comm.core.native import native
from moe_comm.ops import (logfmt_decode, logfmt_decode_reference, logfmt_encode, logfmt_encode_reference,
                          logfmt_row_bytes)
from moe_comm.ops.combine_reduce import combine_reduce, combine_reduce_reference
from moe_comm.ops.logfmt import exp2_reference, log2_reference
from moe_comm.ops.records import RecordLayout

from helpers.bit_checks import assert_same_bits_or_both_nan
from helpers.deepep_utils import calc_diff

# 128: one division; 384: one short chunk; 1536 and 2560: 512-channel chunks; 2048 and 7168: 1024-channel ones
HIDDENS = [128, 384, 512, 1536, 2048, 2560, 7168]


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _bf16(bits: list[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(bits, dtype=torch.int32)
    return torch.where(t >= 0x8000, t - 0x10000, t).to(torch.int16).view(torch.bfloat16)


def _rows(kind: str, num_rows: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 test rows of one family."""
    randn = torch.randn(num_rows, hidden, generator=gen)
    if kind == "small":  # every chunk cast (DeepEP's perf input)
        x = randn * 0.1
    elif kind == "scaled":  # DeepEP's LogFMT inputs: some rows cast, some not
        x = randn * 0.5 * torch.rand(num_rows, 1, generator=gen)
    elif kind == "large":  # |x| >= 1 somewhere in (nearly) every chunk: raw
        x = randn * 3
    elif kind == "mixed":  # chunks alternately raw (one value of 2) and cast
        x = randn * 0.05
        x[:, ::1024] = 2.0
    elif kind == "zeros":  # zeros sprinkled in, and whole zero divisions
        x = (randn * 0.1).masked_fill(torch.rand(num_rows, hidden, generator=gen) < 0.3, 0.0)
        x[:, :128] = 0.0
    elif kind == "all_zero":
        x = torch.zeros(num_rows, hidden).masked_fill(torch.rand(num_rows, hidden, generator=gen) < 0.5, -0.0)
    elif kind == "negative":
        x = -(randn.abs() * 0.1)
    elif kind == "wide_range":  # magnitudes over 2^-140 .. 2^0: the 2^-32 floor, subnormal bf16 and results
        x = randn.sign() * torch.exp2(-140 * torch.rand(num_rows, hidden, generator=gen))
    elif kind == "tiny":  # every value subnormal or near the bottom of bf16
        x = randn * 1e-39
    elif kind == "huge":
        x = randn * 1e38
    elif kind == "constant":  # amin == amax: never cast
        x = torch.full((num_rows, hidden), -0.25)
    elif kind == "specials":  # inf and NaN in a few divisions, the rest small
        x = randn * 0.1
        x[:, 5] = float("inf")
        x[0, -1] = float("nan")
        x[1 % num_rows, hidden // 2] = -float("inf")
    elif kind == "every_bf16":  # all 65536 bit patterns, shuffled
        bits = torch.randperm(65536, generator=gen).repeat(-(-num_rows * hidden // 65536))[:num_rows * hidden]
        return _bf16(bits).view(num_rows, hidden)
    else:
        raise AssertionError(kind)
    return x.to(torch.bfloat16)


KINDS = ["small", "scaled", "large", "mixed", "zeros", "all_zero", "negative", "wide_range", "tiny", "huge",
         "constant", "specials", "every_bf16"]


# ------------------------------------------------------------------------------------ log2 and exp2
def _ulp_error(got: torch.Tensor, want: np.ndarray) -> np.ndarray:
    ulp = np.abs(np.spacing(want.astype(np.float32))).astype(np.float64)
    return np.abs(got.numpy().astype(np.float64) - want) / ulp


def test_log2_is_within_one_ulp():
    gen = _gen("log2")
    bits = torch.cat([torch.randint(1, 0x7F800000, (1 << 21,), generator=gen, dtype=torch.int64).to(torch.int32),
                      torch.arange(1, 0x7F80, dtype=torch.int32) << 16,                       # every bf16
                      torch.arange(0x3F800000 - (1 << 19), 0x3F800000 + (1 << 19), dtype=torch.int32),  # near 1
                      torch.arange(1, 0x00800000, 61, dtype=torch.int32)])                    # subnormals
    x = bits.view(torch.float32)
    err = _ulp_error(log2_reference(x), np.log2(x.numpy().astype(np.float64)))
    assert err.max() < 1.0, f"log2: {err.max():.3f} ulp at {x[int(err.argmax())].item()!r}"


def test_exp2_is_within_1_2_ulp_and_exact_at_integers():
    gen = _gen("exp2")
    y = torch.cat([torch.rand(1 << 21, generator=gen) * 2 - 1, torch.rand(1 << 20, generator=gen) * 254 - 126,
                   torch.rand(1 << 18, generator=gen) * -24 - 126])  # subnormal results
    want = np.exp2(y.numpy().astype(np.float64))
    err = _ulp_error(exp2_reference(y), want)
    assert err.max() < 1.2, f"exp2: {err.max():.3f} ulp at {y[int(err.argmax())].item()!r}"
    k = torch.arange(-149, 128, dtype=torch.float32)
    assert torch.equal(exp2_reference(k), torch.exp2(k.double()).float())
    assert torch.equal(log2_reference(torch.exp2(k.double()).float()), k)


def test_log2_and_exp2_special_values():
    inf, nan = float("inf"), float("nan")
    got = log2_reference(torch.tensor([0.0, -0.0, inf, -inf, -1.0, 1.0, nan]))
    assert got[:3].tolist() == [-inf, -inf, inf] and got[3:5].isnan().all() and got[5] == 0 and got[6].isnan()
    got = exp2_reference(torch.tensor([-inf, inf, 128.0, -150.0, -149.5, nan, 0.0]))
    assert got[:5].tolist() == [0.0, inf, inf, 0.0, 2.0**-149] and got[5].isnan() and got[6] == 1.0


# ------------------------------------------------------------------------------- native == reference
def _check_codec(x: torch.Tensor) -> None:
    hidden = x.shape[1]
    enc = logfmt_encode(x)
    assert torch.equal(enc, logfmt_encode_reference(x)), "encoded bytes differ"
    decoded = logfmt_decode(enc, hidden)
    assert_same_bits_or_both_nan(decoded, logfmt_decode_reference(enc, hidden), "decoded")


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("kind", KINDS)
def test_native_matches_reference_bitwise(kind, hidden):
    _check_codec(_rows(kind, 5, hidden, _gen(kind, hidden)))


@pytest.mark.parametrize("hidden", [384, 2560, 7168])
def test_any_bytes_decode_the_same_natively(hidden):
    """Corrupt or foreign bytes decode to the same values on both paths, reading inside the row only."""
    gen = _gen("bytes", hidden)
    enc = torch.randint(0, 256, (6, logfmt_row_bytes(hidden)), generator=gen, dtype=torch.uint8)
    enc[1::2, :hidden // 128 * 4] &= 0x7F  # metadata of small values: most chunks cast
    assert_same_bits_or_both_nan(logfmt_decode(enc, hidden), logfmt_decode_reference(enc, hidden), "decoded")


def test_zero_rows_and_strided_rows():
    x = _rows("scaled", 9, 2560, _gen("strided"))
    layout = RecordLayout.build([("src", torch.int32, 1), ("x", torch.uint8, logfmt_row_bytes(2560))])
    records = torch.full((9, layout.record_bytes), 0xAB, dtype=torch.uint8)
    view = layout.view(records, "x")
    assert logfmt_encode(x[:, :], out=view) is view
    assert torch.equal(view, logfmt_encode(x))
    assert (records[:, :4] == 0xAB).all(), "bytes outside the field were written"
    wide = torch.zeros(9, 3000, dtype=torch.bfloat16)
    wide[:, 100:2660] = x
    assert torch.equal(logfmt_encode(wide[:, 100:2660]), view)
    assert torch.equal(logfmt_decode(view, 2560), logfmt_decode(view.contiguous(), 2560))
    for encode in (logfmt_encode, logfmt_encode_reference):
        assert encode(x[:0]).shape == (0, logfmt_row_bytes(2560))
    for decode in (logfmt_decode, logfmt_decode_reference):
        assert decode(view[:0], 2560).shape == (0, 2560)


def test_thread_count_does_not_change_bits():
    x = _rows("scaled", 64, 7168, _gen("threads"))
    rb = logfmt_row_bytes(7168)
    outs = []
    for threads in (1, 2, 3):
        enc = torch.empty(64, rb, dtype=torch.uint8)
        native().logfmt_encode_rows(enc.data_ptr(), x.data_ptr(), 64, 7168, rb, 7168, threads)
        dec = torch.empty(64, 7168)
        native().logfmt_decode_rows(dec.data_ptr(), enc.data_ptr(), 64, 7168, rb, threads)
        outs.append((enc, dec))
    for enc, dec in outs[1:]:
        assert torch.equal(enc, outs[0][0]) and torch.equal(dec.view(torch.int32), outs[0][1].view(torch.int32))


# ----------------------------------------------------------------------------------- the format
def _meta(enc: torch.Tensor, d: int) -> tuple[int, int]:
    b = enc[0, 4 * d:4 * d + 4].tolist()
    return b[0] | b[1] << 8, b[2] | b[3] << 8


def _block_codes(block: list[int]) -> tuple[list[int], list[int]]:
    value = sum(byte << (8 * i) for i, byte in enumerate(block))
    return [(value >> (9 * j)) & 0x1FF for j in range(16)], [(value >> (144 + j)) & 1 for j in range(16)]


def test_format_by_hand():
    """One 512-channel row: division 0 holds amax, amin, a zero and a negative value; the chunk is cast."""
    x = torch.full((1, 512), 0.25)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 0.5, 2.0**-10, 0.0, -0.375
    x = x.to(torch.bfloat16)
    enc = logfmt_encode(x)
    bits = x.view(torch.int16).int() & 0xFFFF
    assert _meta(enc, 0) == (int(bits[0, 0]), 0)                      # amax = 0.5, amin = 0 (the zero)
    assert _meta(enc, 1) == (int(bits[0, 200]),) * 2                  # 0.25 everywhere: amin == amax
    # division 1 alone would stay raw (amin == amax), so the whole chunk is raw
    assert torch.equal(enc[0, 16:], x.view(torch.uint8)[0])
    # every division of the chunk castable: 640 payload bytes, 10 bits a channel
    y = x.clone()
    y[0, 128:] = (torch.arange(384) % 7 + 1).to(torch.bfloat16) * 0.0625
    enc = logfmt_encode(y)
    codes, signs = _block_codes(enc[0, 16:36].tolist())
    assert codes[0] == 511 and codes[2] == 0 and 0 < codes[1] < 511 and 0 < codes[3] < 511
    assert signs[:4] == [0, 0, 0, 1]
    assert (enc[0, 16 + 640:] == 0).all(), "a cast 512-channel chunk takes 640 bytes after the metadata"
    dec = logfmt_decode(enc, 512)
    assert dec[0, 2] == 0 and dec[0, 3] < 0
    assert torch.allclose(dec[0], y[0].float(), rtol=0.05, atol=0), "every level within a step of the value"
    assert abs(dec[0, 0].item() - 0.5) < 1e-6


def test_all_cast_row_takes_deepeps_logfmt_bytes():
    """DeepEP's byte count for LogFMT-10 rows: hidden * 10 / 8 + hidden / 128 * 4."""
    x = _rows("small", 3, 7168, _gen("bytes used"))
    enc = logfmt_encode(x)
    used = 7168 * 10 // 8 + 7168 // 128 * 4
    assert (enc[:, used:] == 0).all() and (enc[:, used - 20:used] != 0).any(dim=1).all()


@pytest.mark.parametrize("hidden,width", [(2048, 1024), (7168, 1024), (1536, 512), (2560, 512), (384, 384)])
def test_one_decision_per_chunk(hidden, width):
    """A value >= 1 makes its whole chunk (1024 channels when hidden % 1024 == 0, else 512) raw, and only it."""
    x = (torch.randn(1, hidden, generator=_gen("chunk", hidden)) * 0.1).to(torch.bfloat16)
    c = hidden // width // 2
    x[0, c * width + width // 2 + 3] = 1.0
    dec = logfmt_decode(logfmt_encode(x), hidden)
    exact = (dec[0] == x[0].float()).view(-1, width)
    assert exact[c].all(), "the chunk holding 1.0 travels raw"
    assert (~exact[torch.arange(exact.shape[0]) != c]).any(dim=1).all(), "the other chunks are cast"


def test_nan_and_inf_chunks_travel_raw():
    x = _rows("specials", 3, 2048, _gen("specials"))
    dec = logfmt_decode(logfmt_encode(x), 2048)
    assert torch.isinf(dec[0, 5]) and torch.isnan(dec[0, -1]) and dec[1, 1024] == -float("inf")
    assert torch.equal(dec[:, :1024], x[:, :1024].float()), "chunk 0 of every row holds an Inf: raw"
    assert_same_bits_or_both_nan(dec[0, 1024:], x[0, 1024:].float(), "row 0 chunk 1 holds the NaN: raw")
    assert not torch.equal(dec[2, 1024:], x[2, 1024:].float()), "row 2's chunk 1 is cast"


@pytest.mark.parametrize("hidden", [0, 64, 100, 129, -128])
def test_bad_hidden_is_refused(hidden):
    with pytest.raises(ValueError, match=f"logfmt_row_bytes: hidden must be a positive multiple of 128, got {hidden}"):
        logfmt_row_bytes(hidden)
    with pytest.raises(ValueError, match=f"logfmt_decode: hidden must be a positive multiple of 128, got {hidden}"):
        logfmt_decode(torch.zeros(1, 8, dtype=torch.uint8), hidden)
    if hidden > 0:
        with pytest.raises(ValueError, match=r"logfmt_encode: x.shape\[1\] \(hidden\) must be a positive multiple"):
            logfmt_encode(torch.zeros(2, hidden, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="logfmt: hidden must be a positive multiple of 128"):
        native().logfmt_row_bytes(hidden)


def test_bad_tensors_are_refused():
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"logfmt_encode: x must be \[N, 256\] bfloat16 .*got \[2, 256\] float32"):
        logfmt_encode(x.float())
    with pytest.raises(ValueError, match=r"logfmt_encode: x must be .* with contiguous rows"):
        logfmt_encode(torch.zeros(256, 2, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"logfmt_encode: out must be \[2, 520\] uint8"):
        logfmt_encode(x, out=torch.zeros(2, 519, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"logfmt_decode: enc must be \[N, 520\] uint8"):
        logfmt_decode(torch.zeros(2, 512, dtype=torch.uint8), 256)
    with pytest.raises(TypeError, match=r"logfmt_decode: enc must be"):
        logfmt_decode(torch.zeros(2, 520, dtype=torch.int8), 256)
    with pytest.raises(TypeError, match=r"logfmt_decode: hidden must be a positive multiple of 128, got bool"):
        logfmt_decode(torch.zeros(2, 520, dtype=torch.uint8), True)


# -------------------------------------------------------------------------- the weighted reduction
def _logfmt_records(x: torch.Tensor) -> tuple[RecordLayout, torch.Tensor]:
    layout = RecordLayout.build([("src", torch.int32, 1), ("x", torch.uint8, logfmt_row_bytes(x.shape[1]))])
    records = torch.zeros(x.shape[0], layout.record_bytes, dtype=torch.uint8)
    logfmt_encode(x, out=layout.view(records, "x"))
    return layout, records


@pytest.mark.parametrize("hidden", [384, 2560, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scaled,biased", [(True, False), (False, False), (True, True)])
def test_combine_reduce_logfmt_matches_reference(hidden, dtype, scaled, biased):
    gen = _gen("reduce", hidden, dtype, scaled, biased)
    num_tokens, num_sources, rows = 37, 5, 23
    sources = [_logfmt_records(_rows(kind, rows, hidden, gen))
               for kind in ("scaled", "mixed", "zeros", "small", "wide_range")]
    layout = sources[0][0]
    send_pos = torch.randint(-1, rows, (num_tokens, num_sources), generator=gen, dtype=torch.int32)
    scale = torch.randn(num_tokens, num_sources, generator=gen).abs() if scaled else None
    bias = [torch.randn(num_tokens, hidden, generator=gen).to(dtype) if biased else None for _ in range(2)]
    got = torch.empty(num_tokens, hidden, dtype=dtype)
    want = torch.empty(num_tokens, hidden, dtype=dtype)
    recs = [r for _, r in sources]
    combine_reduce(layout, recs, send_pos, bias[0], bias[1], got, None, scale, x_format="logfmt")
    combine_reduce_reference(layout, recs, send_pos, bias[0], bias[1], want, None, scale, x_format="logfmt")
    assert_same_bits_or_both_nan(got, want, "combined")
    # the same as decoding first and reducing fp32 rows
    plain = RecordLayout.build([("x", torch.float32, hidden)])
    decoded = [logfmt_decode(layout.view(r, "x"), hidden).view(torch.uint8) for r in recs]
    if dtype == torch.float32:
        also = torch.empty(num_tokens, hidden, dtype=dtype)
        combine_reduce(plain, decoded, send_pos, bias[0], bias[1], also, None, scale)
        assert_same_bits_or_both_nan(got, also, "decoded, then reduced")


def test_combine_reduce_logfmt_checks():
    layout, records = _logfmt_records(_rows("small", 4, 256, _gen("checks")))
    out = torch.empty(3, 256, dtype=torch.bfloat16)
    pos = torch.zeros(3, 2, dtype=torch.int32)
    pos[1, 1] = 4
    with pytest.raises(ValueError, match=r"combine_reduce: send_pos\[1, 1\] = 4 is outside \[-1, 4\)"):
        combine_reduce(layout, records, pos, None, None, out, None, x_format="logfmt")
    pos[1, 1] = 0
    with pytest.raises(ValueError, match=r"field x must be \[1040\] uint8 \(logfmt_row_bytes\(512\)\), got \[520\]"):
        combine_reduce(layout, records, pos, None, None, torch.empty(3, 512, dtype=torch.bfloat16), None,
                       x_format="logfmt")
    with pytest.raises(ValueError, match="out_weights must be None"):
        combine_reduce(layout, records, pos, None, None, out, torch.empty(3, 1), x_format="logfmt")
    with pytest.raises(ValueError, match="x_format must be 'plain' or 'logfmt', got 'log'"):
        combine_reduce(layout, records, pos, None, None, out, None, x_format="log")
    with pytest.raises(ValueError, match=r"combine_reduce_logfmt: LogFMT field x \(520 x 1 bytes at byte 8\) "
                                         r"does not fit in a record of record_bytes=100"):
        native().combine_reduce_logfmt(out.data_ptr(), [records.data_ptr()] * 2, [4, 4], pos.data_ptr(), 0, 0, 0,
                                       3, 2, 256, native().DType.BFLOAT16, 100, 8, 1)
    with pytest.raises(ValueError, match="combine_reduce_logfmt: hidden must be a positive multiple of 128, got 200"):
        native().combine_reduce_logfmt(out.data_ptr(), [records.data_ptr()] * 2, [4, 4], pos.data_ptr(), 0, 0, 0,
                                       3, 2, 200, native().DType.BFLOAT16, 528, 8, 1)


# ------------------------------------------------------------------------------ DeepEP's accuracy
def _deepep_inputs(num_tokens: int, hidden: int, rank: int, seed: int) -> list[torch.Tensor]:
    """test_low_latency.py's combine inputs on one rank: the rank-valued rows (last 128 columns = token
    index), four ``randn * 0.5 * random()`` and one ``randn * 0.1``."""
    torch.manual_seed(seed)
    random.seed(seed)
    x = torch.ones(num_tokens, hidden, dtype=torch.bfloat16) * (rank - 128)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    xs = [x] + [torch.randn(num_tokens, hidden, dtype=torch.bfloat16) * 0.5 * random.random() for _ in range(4)]
    return xs + [torch.randn(num_tokens, hidden, dtype=torch.bfloat16) * 0.1]


def logfmt_combine_diffs(num_tokens: int = 128, hidden: int = 7168, num_topk: int = 8, rank: int = 3,
                         seed: int = 0) -> list[float]:
    """calc_diff of the LogFMT weighted combine against the exact one, as DeepEP's test computes it: every
    expert returns the token's row (the simulated GEMM), so the exact result is x * sum of the weights."""
    diffs = []
    for x in _deepep_inputs(num_tokens, hidden, rank, seed):
        topk_idx = torch.randn(num_tokens, 64).abs().add(1).topk(num_topk, dim=-1).indices
        topk_idx.view(-1)[torch.randint(0, num_tokens * num_topk, (10,))] = -1
        weights = torch.randn(num_tokens, num_topk).abs()
        layout, records = _logfmt_records(x)
        pos = torch.where(topk_idx >= 0, torch.arange(num_tokens).view(-1, 1), -1).to(torch.int32)
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16)
        combine_reduce(layout, records, pos, None, None, out, None, weights, x_format="logfmt")
        diffs.append(calc_diff(x * weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1), out))
    return diffs


@pytest.mark.parametrize("rank", [0, 3, 128])
def test_deepep_accuracy_bound(rank):
    """DeepEP asserts calc_diff < 1e-5 for its LogFMT combine with bf16 dispatch."""
    diffs = logfmt_combine_diffs(rank=rank, seed=rank)
    assert max(diffs) < 1e-5, diffs
    assert min(diffs[1:]) > 0, "the random inputs were cast (a lossless result would mean no LogFMT at all)"
