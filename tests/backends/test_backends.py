"""Buffer picks its backend by name, environment, device and build, and says which and why; a
backend that cannot run here is refused with the reason and the backends that can."""
import pytest
import torch

import moe_comm
from moe_comm import backends

from helpers.backend_cases import choices

NO_CUDA_BUILD = not moe_comm.build_info().get("cuda")
CUDA_RUNS = backends.unavailable_reason("cuda") is None
#: the backends that run on a CPU machine: the portable one and the CUDA kernels' host build
CPU_BACKENDS = ["portable", "cuda_host"]


@pytest.fixture(scope="module")
def seen(_world_pool):
    from helpers.transports import local_world
    world = local_world(1, "shm", timeout_s=120, threads_per_rank=1)
    try:
        yield world.run(choices)[0]
    finally:
        world.close()


def test_auto_takes_the_portable_backend_on_cpu_groups_and_says_why(seen):
    name, why, shown = seen["auto"]
    assert name == "portable"
    assert why == "auto: a gloo group holds cpu tensors, which no native backend serves", why
    assert "backend 'portable'" in shown and "transport 'shm'" in shown, shown
    assert seen["explicit"] == ("portable", "backend='portable'")


@pytest.mark.skipif(CUDA_RUNS, reason="the cuda backend can run here")
def test_an_unavailable_backend_is_refused_with_the_reason_and_the_available_ones(seen):
    kind, message = seen["cuda"]
    assert kind == "BackendUnavailableError", seen["cuda"]
    if NO_CUDA_BUILD:
        reason = ("moe_comm._cuda (the device build of csrc/cuda) is not built: build with nvcc on PATH "
                  "(MOE_COMM_CUDA=AUTO|ON)")
    else:  # built (nvcc was found), but this machine has no GPU
        reason = f"torch.cuda.is_available() is False (torch {torch.__version__} is built without CUDA)"
    assert message == f"Buffer: backend='cuda' is not available: {reason}; available here: {CPU_BACKENDS}", message
    kind, message = seen["ascend"]
    assert kind == "BackendUnavailableError" and "backend='ascend' is not available" in message \
        and "torch_npu is not installed" in message and f"available here: {CPU_BACKENDS}" in message, message


@pytest.mark.skipif(CUDA_RUNS, reason="the cuda backend can run here")
def test_the_environment_names_a_backend_unless_the_call_does(seen):
    kind, message = seen["env"]
    assert kind == "BackendUnavailableError" and message.startswith("Buffer: MOE_COMM_BACKEND='cuda' is not "
                                                                    "available: "), seen["env"]
    assert seen["env_overridden"] == "portable"


def test_unknown_and_mistyped_backends_name_the_known_ones(seen):
    assert seen["unknown"] == ("ValueError", "Buffer: backend must be 'auto' or one of ['portable', 'cuda_host', "
                                             "'cuda', 'ascend', 'cambricon'], got backend='tpu'")
    assert seen["not_str"] == ("TypeError", "Buffer: backend must be a str, got NoneType None")


def test_device_facts_come_from_the_backend(seen):
    kind, message = seen["comm_stream"]
    assert kind == "NotImplementedError" and "the portable backend (over the shm transport) has no separate " \
        "communication stream" in message, seen["comm_stream"]
    assert seen["sm90"] is True  # FP8 dispatch runs on every backend


def test_the_registry_lists_what_can_run():
    assert backends.KNOWN == ("portable", "cuda_host", "cuda", "ascend", "cambricon")
    assert backends.unavailable_reason("portable") is None and backends.unavailable_reason("cuda_host") is None
    if not CUDA_RUNS:
        assert backends.available() == CPU_BACKENDS
