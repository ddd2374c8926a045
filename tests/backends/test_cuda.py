"""The device-agnostic path on CUDA tensors over NCCL (world size 1) must equal the CPU path bitwise."""
import pytest
import torch

from moe_comm.launch import LocalWorld
from moe_comm.moe import MODES

from helpers.cuda_cases import cuda_low_latency_matches_cpu, cuda_matches_cpu
from helpers.moe_cases import moe_forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"needs a CUDA device, found {torch.cuda.device_count()}")


def test_nccl_matches_gloo_bitwise():
    with LocalWorld(1, backend="nccl", timeout_s=300) as world:
        assert world.run(cuda_matches_cpu)[0] > 10


def test_nccl_low_latency_matches_gloo_bitwise():
    with LocalWorld(1, backend="nccl", timeout_s=300) as world:
        assert world.run(cuda_low_latency_matches_cpu)[0] > 10


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_ep_moe_on_cuda_matches_dense_reference(fp8):
    with LocalWorld(1, backend="nccl", timeout_s=300) as world:
        for mode in MODES:
            cfg = dict(tokens=[40], hidden=256, inter=256, topk=4, experts=8, mode=mode, num_chunks=3, fp8=fp8, seed=1,
                       device="cuda")
            r = world.run(moe_forward, cfg)[0]
            assert r["bitwise_reference"] and r["accuracy"] and r["repeatable"], (mode, r)
