"""The device-agnostic path on CUDA tensors over NCCL (world size 1) must equal the CPU path bitwise."""
import pytest
import torch

from cuda_cases import cuda_low_latency_matches_cpu, cuda_matches_cpu
from moe_comm.launch import LocalWorld

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"needs a CUDA device, found {torch.cuda.device_count()}")


def test_nccl_matches_gloo_bitwise():
    with LocalWorld(1, backend="nccl", timeout_s=300) as world:
        assert world.run(cuda_matches_cpu)[0] > 10


def test_nccl_low_latency_matches_gloo_bitwise():
    with LocalWorld(1, backend="nccl", timeout_s=300) as world:
        assert world.run(cuda_low_latency_matches_cpu)[0] > 10
