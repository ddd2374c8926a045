"""``moe_comm.ops`` under ``torch.compile``, in one process: every op is a ``torch.ops.moe_comm`` op that
passes ``torch.library.opcheck``; ``permute -> expert_ffn -> unpermute_reduce`` compiles with
``fullgraph=True`` into one graph and gives eager's bits; bad input to a compiled call raises eager's
error; and every op the library registers is checked somewhere."""
from __future__ import annotations

import re

import pytest
import torch

from moe_comm import ops
from moe_comm.core.library import NAMESPACE, op

from helpers.compile_cases import BUFFER_OPS, OPCHECKS
from helpers.ll_hook_cases import _raises

T, H, I, E, K = 16, 256, 128, 4, 2


def _inputs(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[3, 1] = -1
    return dict(x=torch.randn(T, H, generator=gen).bfloat16(), idx=idx, w=torch.rand(T, K, generator=gen),
                w13=(torch.randn(E, 2 * I, H, generator=gen) * 0.05).bfloat16(),
                w2=(torch.randn(E, H, I, generator=gen) * 0.05).bfloat16())


def _op_cases() -> list:
    d = _inputs()
    x, idx, w, w13, w2 = d["x"], d["idx"], d["w"], d["w13"], d["w2"]
    perm = ops.permute(x, idx, E)
    q, s = ops.quantize(x, "e4m3")
    q8, s8 = ops.quantize(x, "int8")
    w13q, w13s = ops.per_block_cast_to_fp8(w13.float())
    w2q, w2s = ops.per_block_cast_to_fp8(w2.float())
    fp8_perm = ops.permute(x, idx, E, quant="e4m3")
    masked_x = torch.randn(E, 8, H).bfloat16()
    counts = torch.tensor([8, 0, 3, 5], dtype=torch.int32)
    return [
        ("permute", (x, idx, E, 1, None, False, False, None, None), OPCHECKS),
        ("permute", (x, idx, E, 8, "e4m3", False, False, ops.max_permuted_rows(T, K, E, 8), None), OPCHECKS),
        ("permute", (x, idx, E, 1, "int8", False, False, None, None), OPCHECKS),
        ("quantize", (x, "e4m3", False, False, None), OPCHECKS),
        ("quantize", (torch.randn(T, 512).bfloat16(), "e4m3", True, True, None), OPCHECKS),
        ("quantize", (x, "int8", False, False, None), OPCHECKS),
        ("dequantize", (q8, s8, torch.bfloat16, None), OPCHECKS),
        # torch's schema check compares FP8 inputs with allclose, which FP8 does not implement
        ("dequantize", (q, s, torch.float32, None), tuple(c for c in OPCHECKS if c != "test_schema")),
        ("dispatch_layout", (idx, 2, E, None), OPCHECKS),
        ("grouped_gemm", (perm.x, w13, perm.expert_offsets, None, None, None, torch.bfloat16, None), OPCHECKS),
        ("grouped_gemm", (masked_x, w13, None, counts, None, None, torch.float32, None), OPCHECKS),
        ("expert_ffn", (perm.x, w13, w2, perm.expert_offsets, None, None, None, None, None), OPCHECKS),
        ("expert_ffn", (masked_x, w13, w2, None, counts, None, None, None, None), OPCHECKS),
        ("expert_ffn", (fp8_perm.x, w13q, w2q, fp8_perm.expert_offsets, None, fp8_perm.scales, w13s, w2s, None),
         tuple(c for c in OPCHECKS if c != "test_schema")),
        ("unpermute_reduce", (perm.x, perm.row_of, w, torch.bfloat16, None), OPCHECKS),
        ("unpermute_reduce", (perm.x, perm.row_of, w, torch.float32, None), OPCHECKS),
        ("take_rows", (torch.empty(3, H).bfloat16(), x, torch.tensor([0, -1, 2])), OPCHECKS),
    ]


@pytest.mark.parametrize("name,args,checks", _op_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_op_passes_opcheck(name, args, checks):
    torch.library.opcheck(op(name), args, test_utils=checks)


def test_every_registered_op_is_checked():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{NAMESPACE}::")}
    checked = {name for name, _, _ in _op_cases()} | BUFFER_OPS
    assert registered == checked, f"registered but not checked: {registered - checked}; checked but gone: " \
                                  f"{checked - registered}"


def _moe(x, idx, w, w13, w2, quant=None):
    perm = ops.permute(x, idx, E, quant=quant, alignment=8 if quant else 1)
    if quant:
        w13q, w13s = ops.per_block_cast_to_fp8(w13.float())
        w2q, w2s = ops.per_block_cast_to_fp8(w2.float())
        y = ops.expert_ffn(perm.x, w13q, w2q, expert_offsets=perm.expert_offsets, x_scales=perm.scales,
                           w13_scales=w13s, w2_scales=w2s)
    else:
        y = ops.expert_ffn(perm.x, w13, w2, expert_offsets=perm.expert_offsets)
    return ops.unpermute_reduce(y, perm.row_of, w)


@pytest.mark.parametrize("quant", [None, "e4m3"])
def test_permute_experts_unpermute_compile_into_one_graph_with_eager_bits(quant):
    d = _inputs(1)
    args = (d["x"], d["idx"], d["w"], d["w13"], d["w2"])
    torch._dynamo.reset()
    compiled = torch.compile(_moe, fullgraph=True, dynamic=True)
    eager = _moe(*args, quant=quant)
    assert torch.equal(compiled(*args, quant=quant).view(torch.int16), eager.view(torch.int16))
    fewer = _inputs(2)
    fewer = (fewer["x"][:9], fewer["idx"][:9], fewer["w"][:9], d["w13"], d["w2"])  # another token count
    assert torch.equal(compiled(*fewer, quant=quant).view(torch.int16), _moe(*fewer, quant=quant).view(torch.int16))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(_moe)(*args, quant=quant)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _out_of_range_expert(d):
    idx = d["idx"].clone()
    idx[5, 0] = E + 3
    return _moe(d["x"], idx, d["w"], d["w13"], d["w2"])


def _out_of_range_row(d):
    perm = ops.permute(d["x"], d["idx"], E)
    return ops.unpermute_reduce(perm.x, perm.row_of + 1000, d["w"])


def _decreasing_offsets(d):
    perm = ops.permute(d["x"], d["idx"], E)
    return ops.grouped_gemm(perm.x, d["w13"], expert_offsets=perm.expert_offsets.flip(0))


@pytest.mark.parametrize("case", [_out_of_range_expert, _out_of_range_row, _decreasing_offsets],
                         ids=lambda f: f.__name__.strip("_"))
def test_bad_values_raise_the_eager_error_inside_a_compiled_call(case):
    d = _inputs(3)
    eager = _raises(lambda: case(d))
    assert eager.startswith("ValueError: "), eager
    torch._dynamo.reset()
    assert _raises(lambda: torch.compile(case, fullgraph=True)(d)) == eager


def _direct_calls() -> list:
    d = _inputs(4)
    x, idx = d["x"], d["idx"]
    return [
        ("quantize", (x, "e4m3", True, True, None), "use_ue8m0 needs round_scale=True and a hidden size that is a "
                                                    "multiple of 512"),
        ("permute", (x, idx, E, 1, "e4m3", False, False, 2, None), "num_rows must be an int >= "),
        ("permute", (x[:, :100], idx, E, 1, "e4m3", False, False, None, None), "multiple of 128, got 100"),
        ("dequantize", (ops.quantize(x)[0], torch.ones(T, 1), torch.bfloat16, None), "scales for"),
        ("take_rows", (torch.empty(3, H).bfloat16(), x, torch.tensor([0, 99, 2])), "outside"),
        ("take_rows", (torch.empty(3, 8).bfloat16(), x, torch.tensor([0, 1, 2])), "do not fit"),
        ("unpermute_reduce", (x, idx, d["w"][:, :1], torch.bfloat16, None), "topk_weights must be"),
        ("dispatch_layout", (idx, 3, E, None), "multiple of num_ranks"),
        ("expert_ffn", (x, d["w13"], d["w2"][:, :, :8], torch.tensor([0, 4, 8, 12, 16]), None, None, None, None,
                        None), "w2 must be"),
    ]


@pytest.mark.parametrize("name,args,message", _direct_calls(), ids=lambda v: v if isinstance(v, str) and
                         " " not in v else "")
def test_an_op_called_directly_checks_its_arguments(name, args, message):
    """``torch.ops.moe_comm.*`` is public: the op itself checks what its native code relies on."""
    with pytest.raises(ValueError, match=re.escape(message)):
        op(name)(*args)
