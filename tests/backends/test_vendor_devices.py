"""The vendor backends on their own devices: the contract suites of test_vendor_backends.py with the
real ``torch_npu`` / ``torch_mlu`` on an hccl / cncl group of NPU / MLU ranks (the device set as each
rank's default, one device per rank). ``pytest -m ascend`` / ``pytest -m mlu`` select them; where the
device is absent they skip with the reason, and are never reported as passing."""
from __future__ import annotations

from functools import partial

import pytest

from moe_comm import backends
from moe_comm.launch import LocalWorld

from helpers import vendor_cases

ASCEND_WHY = backends.unavailable_reason("ascend")
MLU_WHY = backends.unavailable_reason("cambricon")


def _on_device(group, device_type: str, case, **kw):
    """``case`` with the rank's device as torch's default (tensors the case makes live there)."""
    import torch
    import torch.distributed as dist
    getattr(torch, device_type).set_device(dist.get_rank(group))
    torch.set_default_device(device_type)
    return case(group, **kw)


def _device_world(ranks: int, backend: str) -> LocalWorld:
    return LocalWorld(ranks, backend=backend, timeout_s=300, threads_per_rank=1)


@pytest.mark.ascend
@pytest.mark.skipif(ASCEND_WHY is not None, reason=f"no Ascend NPU here: {ASCEND_WHY}")
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_ascend_on_npus_is_the_portable_backends(ranks):
    world = _device_world(ranks, "hccl")
    try:
        for fp8 in (False, True):
            problems = world.run(partial(_on_device, device_type="npu", case=vendor_cases.compare_low_latency,
                                         backend="ascend", num_tokens=128, hidden=7168, num_topk=8,
                                         num_experts=ranks * 8, use_fp8=fp8))
            assert not [p for rank in problems for p in rank], problems
        problems = world.run(partial(_on_device, device_type="npu", case=vendor_cases.compare_normal, backend="ascend",
                                     num_tokens=512, hidden=7168, num_topk=8, num_experts=ranks * 8))
        assert not [p for rank in problems for p in rank], problems
    finally:
        world.close()


@pytest.mark.mlu
@pytest.mark.skipif(MLU_WHY is not None, reason=f"no Cambricon MLU here: {MLU_WHY}")
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_cambricon_on_mlus_is_the_portable_backends(ranks):
    world = _device_world(ranks, "cncl")
    try:
        for case in (vendor_cases.compare_low_latency, vendor_cases.compare_normal):
            problems = world.run(partial(_on_device, device_type="mlu", case=case, backend="cambricon",
                                         num_tokens=128, hidden=7168, num_topk=8, num_experts=ranks * 8))
            assert not [p for rank in problems for p in rank], problems
    finally:
        world.close()


@pytest.mark.ascend
@pytest.mark.skipif(ASCEND_WHY is not None, reason=f"no Ascend NPU here: {ASCEND_WHY}")
@pytest.mark.parametrize("quant", [None, "int8"])
def test_ops_on_npus_are_their_references(quant):
    """permute on npu_moe_init_routing_v2 (bitwise) and grouped_gemm on npu_grouped_matmul (the accuracy
    standard), against the references on the CPU."""
    import torch

    from moe_comm.accuracy import check
    from moe_comm.ops import grouped_gemm, grouped_gemm_reference, permute, permute_reference
    x = torch.randn(256, 1024).to(torch.bfloat16)
    idx = torch.rand(256, 64).topk(8, dim=1).indices
    idx[::7, 3] = -1
    want = permute_reference(x, idx, 64, quant=quant)
    got = permute(x.to("npu"), idx.to("npu"), 64, quant=quant)
    for name in ("x", "scales", "expert_offsets", "num_tokens_per_expert", "row_of", "source", "expert_of_row"):
        expected, value = getattr(want, name), getattr(got, name)
        assert (expected is None and value is None) or torch.equal(value.cpu(), expected), name
    b = torch.randn(64, 512, 1024).to(torch.bfloat16)
    out = grouped_gemm(want.x.to("npu") if quant is None else x.new_zeros(want.x.shape).to("npu"), b.to("npu"),
                       expert_offsets=want.expert_offsets.to("npu"))
    ref = grouped_gemm_reference(want.x if quant is None else x.new_zeros(want.x.shape), b,
                                 expert_offsets=want.expert_offsets)
    assert check("grouped_gemm on npu", out.cpu(), ref.to(torch.float64), torch.bfloat16, raise_on_fail=False).passed
