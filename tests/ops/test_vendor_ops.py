"""The ops' NPU paths (``moe_comm/ops/npu.py``: ``permute`` as ``npu_moe_init_routing_v2``, the contiguous
``grouped_gemm`` as ``npu_grouped_matmul``) against the ops' references, through the CPU model of those
operators in ``vendor_models/torch_npu`` (loaded here under another name, so ``import torch_npu`` stays
what it is in this process). This checks the argument mapping and output conversion against the
operators' documentation; ``pytest -m ascend`` on an NPU checks them against the operators."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from moe_comm.accuracy import check
from moe_comm.ops import grouped_gemm_reference, permute_reference
from moe_comm.ops.npu import grouped_gemm_npu, permute_npu

from helpers.paths import HELPERS

_PATH = str(HELPERS / "vendor_models" / "torch_npu" / "__init__.py")


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location("torch_npu_model", _PATH,
                                                  submodule_search_locations=[os.path.dirname(_PATH)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its own `from . import npu` resolves under this name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    sys.modules.pop(spec.name + ".npu", None)


def _routing(tokens: int, topk: int, experts: int, holes: int) -> torch.Tensor:
    scores = torch.rand(tokens, experts)
    idx = scores.topk(topk, dim=1).indices
    for i in range(holes):
        idx[(7 * i) % tokens, i % topk] = -1
    return idx


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("tokens,topk,experts,holes,num_rows", [(9, 2, 4, 3, None), (16, 4, 8, 0, 70), (5, 1, 6, 5, None)])
def test_permute_on_init_routing_v2_is_the_reference(model, quant, tokens, topk, experts, holes, num_rows):
    x = torch.randn(tokens, 64).to(torch.bfloat16)
    idx = _routing(tokens, topk, experts, holes)
    want = permute_reference(x, idx, experts, quant=quant, num_rows=num_rows)
    got = permute_npu(model, x, idx, experts, quant, lambda offsets: num_rows or int(offsets[-1]))
    names = ("x", "scales", "expert_offsets", "num_tokens_per_expert", "row_of", "source", "expert_of_row")
    for name, value in zip(names, got):
        expected = getattr(want, name)
        if expected is None:
            assert value is None, name
            continue
        assert value.dtype == expected.dtype and value.shape == expected.shape, (name, value.shape, expected.shape)
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("first", [0, 3])
def test_grouped_gemm_on_grouped_matmul_is_within_the_accuracy_standard(model, first):
    experts, k, n = 3, 64, 32
    counts = torch.tensor([5, 0, 7])
    offsets = torch.cat([torch.tensor([first]), first + counts.cumsum(0)])
    a = torch.randn(int(offsets[-1]) + 2, k).to(torch.bfloat16)
    b = torch.randn(experts, n, k).to(torch.bfloat16)
    out = torch.zeros(a.shape[0], n, dtype=torch.bfloat16)
    grouped_gemm_npu(model, a, b, offsets[:-1], offsets[1:], out)
    want = grouped_gemm_reference(a, b, expert_offsets=offsets)
    assert torch.equal(out[:first], torch.zeros_like(out[:first])) and torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    report = check("grouped_gemm npu", out, want.to(torch.float64), torch.bfloat16, raise_on_fail=False)
    assert report.passed, report.reason
