"""The fused MoE ops on every device and implementation present, held to ``moe_comm.accuracy``'s standard.

Triton runs in its CPU interpreter here (conftest sets TRITON_INTERPRET=1 without a GPU), TileLang as its
CPU build (target ``c``); CUDA cases skip without a GPU. Shapes are small: the interpreter runs programs
one after another. TileLang has programs for the ops in ``ops.impl.TILELANG_OPS`` and FP8 (no INT8) casts.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from moe_comm import accuracy, ops
from moe_comm.accuracy.suite import CASES, _routing
from moe_comm.ops.impl import tilelang_covers, tilelang_usable

from helpers.bit_checks import assert_same_bits_or_both_nan

TARGETS = [("cpu", "native"), ("cpu", "triton"), ("cpu", "tilelang"), ("cuda", "native"), ("cuda", "triton"),
           ("cuda", "tilelang")]


def _skip_unless(device: str, impl: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    usable, why = {"triton": ops.triton_usable, "tilelang": tilelang_usable}.get(
        impl, lambda _: (True, ""))(torch.device(device))
    if not usable:
        pytest.skip(why)
    return torch.device(device)


def _formats(impl: str, *cases: tuple) -> tuple:
    """The (format, ...) cases ``impl`` has programs for (TileLang: ``tilelang_covers``; the casts, FP8 only)."""
    return tuple(case for case in cases if impl != "tilelang" or tilelang_covers("quantize", case[0]))


@pytest.fixture(params=TARGETS, ids=[f"{d}-{b}" for d, b in TARGETS])
def target(request) -> tuple[torch.device, str]:
    device, impl = request.param
    return _skip_unless(device, impl), impl


@pytest.mark.parametrize("op", sorted(CASES))
def test_standard(op, target):
    """Every check of the accuracy suite for ``op`` passes (exact where data only moves)."""
    device, impl = target
    if impl == "tilelang" and not tilelang_covers(op):
        pytest.skip(f"TileLang has no {op} program")
    failed = [accuracy.check(what, out, ref, dtype, raise_on_fail=False) for what, out, ref, dtype in
              CASES[op](device, impl)]
    failed = [f"{r.op}: {r.reason}" for r in failed if not r.passed]
    assert not failed, failed


def _same(a, b) -> None:
    for name in ("x", "expert_offsets", "num_tokens_per_expert", "row_of", "source", "expert_of_row"):
        accuracy.check(name, getattr(a, name), getattr(b, name).to(getattr(a, name).device))
    assert (a.scales is None) == (b.scales is None)
    if b.scales is not None:
        accuracy.check("scales", a.scales, b.scales.to(a.scales.device))


@pytest.mark.parametrize("tokens,topk,experts,alignment", [(0, 4, 8, 16), (7, 1, 3, 1), (5, 3, 64, 128), (64, 8, 4, 2)])
def test_permute_shapes(target, tokens, topk, experts, alignment):
    """Empty input, one slot, more experts than tokens (most empty), big alignment, repeated experts."""
    device, impl = target
    x = torch.randn(tokens, 128).bfloat16()
    idx = torch.randint(-1, experts, (tokens, topk), generator=torch.Generator().manual_seed(tokens))
    out = ops.permute(x.to(device), idx.to(device), experts, alignment=alignment, impl=impl)
    ref = ops.permute_reference(x, idx, experts, alignment=alignment)
    _same(out, ref)
    assert int(out.expert_offsets[-1]) % alignment == 0


def test_permute_fixed_rows_and_all_unrouted(target):
    device, impl = target
    x, idx = torch.randn(6, 128).bfloat16(), torch.full((6, 2), -1, dtype=torch.int64)
    idx[2, 1] = 3
    rows = ops.max_permuted_rows(6, 2, 4, alignment=8)
    out = ops.permute(x.to(device), idx.to(device), 4, alignment=8, num_rows=rows, quant="e4m3", impl=impl)
    ref = ops.permute_reference(x, idx, 4, alignment=8, num_rows=rows, quant="e4m3")
    _same(out, ref)
    assert out.x.shape == (rows, 128) and int((out.source >= 0).sum()) == 1
    with pytest.raises(ValueError, match="num_rows must be an int >= 8"):
        ops.permute(x.to(device), idx.to(device), 4, alignment=8, num_rows=7, impl=impl)


def test_gemm_ragged_shapes(target):
    """K and N that are not multiples of any block, an empty expert, masked rows with counts 0 and M."""
    device, impl = target
    a, b = torch.randn(37, 100).bfloat16(), (torch.randn(3, 70, 100) / 10).bfloat16()
    offsets = torch.tensor([0, 20, 20, 33])
    out = ops.grouped_gemm(a.to(device), b.to(device), expert_offsets=offsets.to(device), impl=impl)
    ref = ops.grouped_gemm_reference(a, b, expert_offsets=offsets)
    accuracy.check("gemm", out, ref, torch.bfloat16)
    assert not out[33:].any(), "rows past the last expert must be zero"
    a3, masked = torch.randn(3, 9, 100).bfloat16(), torch.tensor([0, 9, 4], dtype=torch.int32)
    out = ops.grouped_gemm(a3.to(device), b.to(device), masked_m=masked.to(device), impl=impl)
    accuracy.check("masked", out, ops.grouped_gemm_reference(a3, b, masked_m=masked), torch.bfloat16)
    assert not out[0].any() and not out[2, 4:].any()


@pytest.mark.parametrize("bf16_units", [False, True])
def test_native_gemm_on_cpus_with_and_without_bf16_units(monkeypatch, bf16_units):
    """The native path multiplies in bf16 where the CPU has bf16 units, else in fp32: both meet the standard,
    and SwiGLU keeps its fp32 products either way."""
    gemm_module = importlib.import_module("moe_comm.ops.grouped_gemm")  # ops exports a function of that name
    monkeypatch.setattr(gemm_module, "_cpu_has_bf16_matmul", lambda: bf16_units)
    offsets = torch.tensor([0, 40, 40, 97])
    a, b = torch.randn(97, 256).bfloat16(), (torch.randn(3, 96, 256) / 16).bfloat16()
    out = ops.grouped_gemm(a, b, expert_offsets=offsets, impl="native")
    accuracy.check("gemm", out, ops.grouped_gemm_reference(a, b, expert_offsets=offsets), torch.bfloat16)
    w2 = (torch.randn(3, 256, 48) / 8).bfloat16()
    out = ops.expert_ffn(a, b, w2, expert_offsets=offsets, impl="native")
    accuracy.check("ffn", out, ops.expert_ffn_reference(a, b, w2, expert_offsets=offsets), torch.bfloat16)


def test_gemm_many_tiles(target):
    """More row tiles than one L2 group (8 tiles) with a partial last group, in both layouts."""
    device, impl = target
    experts = 12
    counts = torch.tensor([70, 0, 3, 130, 64, 1, 0, 200, 9, 65, 12, 40])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    a, b = torch.randn(int(offsets[-1]), 64).bfloat16(), (torch.randn(experts, 48, 64) / 8).bfloat16()
    out = ops.grouped_gemm(a.to(device), b.to(device), expert_offsets=offsets.to(device), impl=impl)
    accuracy.check("gemm", out, ops.grouped_gemm_reference(a, b, expert_offsets=offsets), torch.bfloat16)
    a3 = torch.randn(experts, 200, 64).bfloat16()
    masked = counts.clamp(max=200).to(torch.int32)
    out = ops.grouped_gemm(a3.to(device), b.to(device), masked_m=masked.to(device), impl=impl)
    accuracy.check("masked", out, ops.grouped_gemm_reference(a3, b, masked_m=masked), torch.bfloat16)


def test_deterministic(target):
    """Same inputs, same bits, run after run (fixed reduction orders, no float atomics)."""
    device, impl = target
    idx = _routing(30, 8, 4, seed=3).to(device)
    x = torch.randn(30, 256).bfloat16().to(device)
    perm = ops.permute(x, idx, 8, alignment=4, impl=impl)
    w = (torch.randn(8, 128, 256) / 16).bfloat16().to(device)
    weights = torch.rand(30, 4).to(device)
    runs = []
    for _ in range(2):
        y = ops.grouped_gemm(perm.x, w, expert_offsets=perm.expert_offsets, impl=impl)
        runs.append((y, ops.unpermute_reduce(y, perm.row_of, weights, impl=impl)))
    for first, second in zip(*runs):
        accuracy.check("rerun", second, first)


def test_unpermute_nan_propagates(target):
    """A NaN expert output reaches its token (nothing is silently dropped), and only that token."""
    device, impl = target
    y = torch.ones(4, 128)
    y[2, 5] = float("nan")
    row_of = torch.tensor([[0, 2], [1, -1]])
    out = ops.unpermute_reduce(y.to(device), row_of.to(device), torch.ones(2, 2).to(device), impl=impl)
    assert torch.isnan(out[0, 5]) and torch.isfinite(out[1]).all()


def test_low_latency_uses_the_quantizer():
    """The low-latency dispatch casts with ``ops.quantize``: the same codes as DeepEP's formulas."""
    x = torch.randn(4, 512).bfloat16()
    q, s = ops.quantize(x, "e4m3", round_scale=True, use_ue8m0=True)
    q_ref, s_ref = ops.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    accuracy.check("codes", q, q_ref)
    accuracy.check("scales", s, s_ref)


_X, _IDX = torch.zeros(4, 256).bfloat16(), torch.zeros(4, 2, dtype=torch.int64)
_B = torch.zeros(2, 64, 256).bfloat16()
_OFFS = torch.tensor([0, 2, 4])
BAD_INPUT = [
    (lambda: ops.permute(_X, _IDX.int(), 2), TypeError, "topk_idx must be int64, got torch.int32"),
    (lambda: ops.permute(_X, _IDX[:3], 2), ValueError, r"topk_idx must be \[T, K\] with T = 4"),
    (lambda: ops.permute(_X, _IDX + 2, 2), ValueError, r"entries must be -1 or in \[0, 2\), got values in \[2, 2\]"),
    (lambda: ops.permute(_X, _IDX, 2, alignment=0), ValueError, "alignment must be a positive int, got 0"),
    (lambda: ops.permute(_X, _IDX, 2, quant="fp4"), ValueError, "fmt must be one of"),
    (lambda: ops.permute(_X[:, :100], _IDX, 2, quant="e4m3"), ValueError, "multiple of 128, got 100"),
    (lambda: ops.quantize(_X, "int8", round_scale=True), ValueError, "apply to FP8 only"),
    (lambda: ops.quantize(_X, "e4m3", use_ue8m0=True), ValueError, "use_ue8m0 needs round_scale=True"),
    (lambda: ops.quantize(_X.int(), "e4m3"), TypeError, "x must be bfloat16, float16 or float32, got torch.int32"),
    (lambda: ops.dequantize(_X, torch.ones(4)), ValueError, "q must be"),
    (lambda: ops.dequantize(_X.to(torch.int8), torch.ones(3)), ValueError, r"must be float32 \[4\]"),
    (lambda: ops.grouped_gemm(_X, _B), ValueError, "exactly one of expert_offsets"),
    (lambda: ops.grouped_gemm(_X, _B, expert_offsets=_OFFS, masked_m=_OFFS[:2]), ValueError, "exactly one"),
    (lambda: ops.grouped_gemm(_X[:, :100], _B, expert_offsets=_OFFS), ValueError, r"a must be \[M, 256\]"),
    (lambda: ops.grouped_gemm(_X, _B, expert_offsets=_OFFS[:2]), ValueError, r"expert_offsets must be int32/int64 \[3\]"),
    (lambda: ops.grouped_gemm(_X, _B, expert_offsets=torch.tensor([0, 3, 2])), ValueError, "non-decreasing"),
    (lambda: ops.grouped_gemm(_X, _B.half(), expert_offsets=_OFFS), TypeError, "must both be"),
    (lambda: ops.grouped_gemm(_X.to(torch.float8_e4m3fn), _B.to(torch.float8_e4m3fn), expert_offsets=_OFFS),
     ValueError, "a_scales and b_scales are required exactly when"),
    (lambda: ops.grouped_gemm(_X.to(torch.float8_e4m3fn), _B.to(torch.float8_e4m3fn), expert_offsets=_OFFS,
                              a_scales=torch.ones(4, 2), b_scales=torch.ones(2, 1, 1)), ValueError,
     r"b_scales must be float32 \[2, 1, 2\]"),
    (lambda: ops.expert_ffn(_X, torch.zeros(2, 64, 256).bfloat16(), torch.zeros(2, 256, 16).bfloat16(),
                            expert_offsets=_OFFS), ValueError, r"w2 must be \[2, 256, 32\]"),
    (lambda: ops.unpermute_reduce(_X, _IDX, torch.ones(4, 3)), ValueError, r"topk_weights must be float32 \[4, 2\]"),
    (lambda: ops.unpermute_reduce(_X, _IDX + 4, torch.ones(4, 2)), ValueError, r"must be -1 or in \[0, 4\)"),
    (lambda: ops.dispatch_layout(_IDX, 2, 4, impl="cuda"), ValueError,
     r"impl must be one of \['native', 'triton', 'tilelang'\]"),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUT, ids=[m[:40] for _, _, m in BAD_INPUT])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="impl 'triton' cannot run on cpu tensors: .*TRITON_INTERPRET=1"):
        ops.quantize(_X, impl="triton")
    monkeypatch.setenv("MOE_COMM_OPS_IMPL", "fast")
    with pytest.raises(ValueError, match="MOE_COMM_OPS_IMPL must be one of"):
        ops.quantize(_X)


def test_the_old_name_of_impl_still_works_and_warns(monkeypatch):
    """``backend=`` (ops) and MOE_COMM_OPS_BACKEND are impl's old names: same result, a DeprecationWarning,
    and an error when they contradict the new name; ``ops.BACKENDS`` likewise."""
    want = ops.quantize(_X, "e4m3", impl="native")
    with pytest.warns(DeprecationWarning, match=r"quantize: the keyword backend= is deprecated, use impl=") as seen:
        got = ops.quantize(_X, "e4m3", backend="native")
    assert seen[0].filename == __file__  # the warning names the caller's line
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    with pytest.warns(DeprecationWarning), \
            pytest.raises(ValueError, match=r"quantize: impl='native' and its deprecated name backend='triton' disagree"):
        ops.quantize(_X, impl="native", backend="triton")
    monkeypatch.setenv("MOE_COMM_OPS_BACKEND", "fast")
    with pytest.warns(DeprecationWarning, match="MOE_COMM_OPS_BACKEND is deprecated"), \
            pytest.raises(ValueError, match="MOE_COMM_OPS_BACKEND must be one of"):
        ops.quantize(_X)
    monkeypatch.setenv("MOE_COMM_OPS_IMPL", "native")  # the new name wins
    ops.quantize(_X)
    with pytest.warns(DeprecationWarning, match="BACKENDS is deprecated"):
        assert ops.BACKENDS == ops.IMPLS


def test_standard_fails_what_it_should():
    """The standard is not vacuous: a one-ulp change breaks exact, noise beyond bf16 and any NaN fail."""
    ref = torch.randn(64, 64, dtype=torch.float64)
    out = ref.to(torch.bfloat16)
    accuracy.check("bf16 rounding", out, ref, torch.bfloat16)
    with pytest.raises(accuracy.AccuracyError, match="calc_diff|mere|mare"):
        accuracy.check("noise", (ref * (1 + 0.05 * torch.randn_like(ref))).float(), ref, torch.bfloat16)
    nan = out.clone()
    nan[3, 3] = float("nan")
    with pytest.raises(accuracy.AccuracyError, match="1 NaN/Inf elements"):
        accuracy.check("nan", nan, ref, torch.bfloat16)
    bumped = out.clone()
    bumped.view(torch.int16)[0, 0] += 1
    with pytest.raises(accuracy.AccuracyError, match="1 of 8192 bytes differ"):
        accuracy.check("one ulp", bumped, out)
    with pytest.raises(accuracy.AccuracyError, match=r"expected torch.bfloat16 \[64, 64\]"):
        accuracy.check("dtype", out.float(), out)
    assert set(accuracy.STANDARD) == {torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                      torch.float8_e5m2, torch.int8}
    assert accuracy.calc_diff(ref, ref) == 0.0 and accuracy.calc_diff(ref, -ref) == 2.0


@pytest.mark.parametrize("hidden", [1152, 1536])
def test_quantize_partial_steps(target, hidden):
    """FP8 kernels take 8 groups of 128 channels per step: 9 and 12 groups leave a partial last step."""
    device, impl = target
    x = torch.randn(5, hidden).bfloat16() * 3
    for fmt, round_scale, ue8m0 in _formats(impl, ("e4m3", False, False), ("e5m2", True, hidden % 512 == 0),
                                            ("int8", False, False)):
        q, s = ops.quantize(x.to(device), fmt, round_scale=round_scale, use_ue8m0=ue8m0, impl=impl)
        q_ref, s_ref = ops.quantize_reference(x, fmt, round_scale=round_scale, use_ue8m0=ue8m0)
        accuracy.check("codes", q, q_ref)
        accuracy.check("scales", s, s_ref)
        accuracy.check("dequantize", ops.dequantize(q, s, impl=impl), ops.dequantize_reference(q_ref, s_ref))


def _fp32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).to(torch.int32).view(torch.float32)


def _groups_with_amax(values: torch.Tensor, amax: float) -> torch.Tensor:
    """Rows of 8 groups of 128 channels holding all of ``values`` (|v| <= amax, zero padded), each group led
    by ``amax``: with ``q_max == amax`` the scale is exactly 1, so the codes are the casts of the values."""
    groups = torch.cat([values, values.new_zeros(-values.numel() % (8 * 127))]).view(-1, 127)
    lead = torch.full((groups.shape[0], 1), amax, dtype=torch.float32)
    return torch.cat([lead, groups], dim=1).reshape(-1, 8 * 128)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_codes_match_torch_at_every_rounding_case(target, fmt):
    """Every impl's FP8 codes equal torch's cast bit for bit: all fp32 magnitudes up to the format's max
    with the low 16 bits at 0, 1, 0x7fff, 0x8000, 0x8001, 0xffff (exact ties, both neighbours of them, and
    subnormal codes included), both signs."""
    device, impl = target
    q_max = torch.finfo(ops.FORMATS[fmt]).max
    top = int(torch.tensor(q_max, dtype=torch.float32).view(torch.int32)) >> 16
    highs = torch.arange(top, dtype=torch.int64) << 16
    bits = (highs[:, None] + torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])).reshape(-1)
    values = _fp32_from_bits(bits)
    values = torch.cat([values, -values])
    if device.type == "cuda" or impl == "native":
        chosen = values
    else:  # the interpreter runs one program at a time: every 16th value keeps it to seconds
        chosen = values[::16]
    x = _groups_with_amax(chosen, q_max)
    q, _ = ops.quantize(x.to(device), fmt, impl=impl)
    q_ref, _ = ops.quantize_reference(x, fmt)
    values = x.view(-1, 128)[:, 1:]  # the reference is torch's own cast of every value
    assert torch.equal(q_ref.view(-1, 128)[:, 1:].view(torch.uint8), values.to(ops.FORMATS[fmt]).view(torch.uint8))
    accuracy.check("codes", q, q_ref)


def test_int8_codes_round_half_to_even(target):
    """INT8 codes of exact halves round to even, as torch.round: amax 127 makes the scale exactly 1."""
    device, impl = target
    halves = torch.arange(-126, 127, dtype=torch.float32) + 0.5
    x = torch.cat([torch.tensor([127.0]), halves, torch.tensor([-0.5, 0.5, 1.5, -1.5])]).view(1, -1)
    if impl == "tilelang":
        with pytest.raises(ValueError, match="quantize: impl 'tilelang' has no int8 program"):
            ops.quantize(x.to(device), "int8", impl=impl)
        return
    q, s = ops.quantize(x.to(device), "int8", impl=impl)
    q_ref, s_ref = ops.quantize_reference(x, "int8")
    assert torch.equal(q_ref[0, 1:].float(), torch.round(x[0, 1:]))
    accuracy.check("codes", q, q_ref)
    accuracy.check("scales", s, s_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt,round_scale,ue8m0", [("e4m3", False, False), ("e4m3", True, True),
                                                   ("e5m2", True, False), ("int8", False, False)])
def test_native_quantize_and_fused_permute_match_torch(dtype, fmt, round_scale, ue8m0):
    """The C++ cast (quantize, and permute's gather + cast in one pass) gives torch's codes and scales bit
    for bit, for each input dtype, tiny and huge magnitudes, and rows with a NaN or Inf (a group with a NaN
    is NaN in both; NaN payloads are not compared: torch's own differ with the tensor's size)."""
    torch.manual_seed(7)
    x = (torch.randn(40, 1024) * torch.logspace(-12, 4, 40)[:, None]).to(dtype)
    x[3, 5], x[4, 700], x[5, 9], x[6] = float("nan"), float("inf"), -float("inf"), 0.0
    q, s = ops.quantize(x, fmt, round_scale=round_scale, use_ue8m0=ue8m0, impl="native")
    q_ref, s_ref = ops.quantize_reference(x, fmt, round_scale=round_scale, use_ue8m0=ue8m0)
    assert_same_bits_or_both_nan(q, q_ref, "codes")
    assert_same_bits_or_both_nan(s, s_ref, "scales")
    assert bool(s_ref.float().isnan().any()) == (not round_scale), "the NaN row reaches its scale"
    idx = _routing(40, 8, 3, seed=5)
    got = ops.permute(x, idx, 8, alignment=4, quant=fmt, round_scale=round_scale, use_ue8m0=ue8m0,
                      impl="native")
    want = ops.permute_reference(x, idx, 8, alignment=4, quant=fmt, round_scale=round_scale, use_ue8m0=ue8m0)
    for name in ("x", "scales", "row_of", "source"):
        assert_same_bits_or_both_nan(getattr(got, name), getattr(want, name), name)

