"""The vendor modules as they are installed on machines without their SDKs: ``torch_npu`` installs
from PyPI and fails at import (its extension links CANN's libhccl.so). A Buffer on CPU tensors still
works there, and asking for the vendor backend names what is missing.

torch itself loads installed device extensions when it is imported (its ``torch.backends`` entry
points), so with torch-npu installed and CANN absent ``import torch`` fails before moe-comm runs,
unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch's own switch, which its message names)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import moe_comm
from moe_comm import backends

# `make test` installs the real torch-npu wheel here, without its dependencies (it pins another torch)
TORCH_NPU_DIR = os.path.join(os.path.dirname(os.path.dirname(moe_comm.__file__)), ".venv", "torch-npu")

_BODY = """
import os, tempfile, torch, torch.distributed as dist, moe_comm
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
buffer = moe_comm.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True, timeout_s=30)
print("AUTO", buffer.backend_choice.name)
buffer.destroy()
try:
    moe_comm.Buffer(dist.group.WORLD, backend={backend!r})
except moe_comm.BackendUnavailableError as exc:
    print("REFUSED", exc)
"""


def _run(backend: str, path: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run([sys.executable, "-c", _BODY.format(backend=backend)], capture_output=True, text=True,
                          timeout=300, env=env)


def _out(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(not os.path.isdir(TORCH_NPU_DIR), reason=f"torch-npu is not installed in {TORCH_NPU_DIR} "
                                                              f"(make test installs it)")
def test_torch_npu_without_cann_leaves_cpu_buffers_working_and_names_libhccl():
    autoloaded = _run("ascend", TORCH_NPU_DIR)
    assert autoloaded.returncode != 0 and "Failed to load the backend extension: torch_npu. You can disable extension " \
        "auto-loading with TORCH_DEVICE_BACKEND_AUTOLOAD=0" in autoloaded.stderr, autoloaded.stderr[-2000:]
    out = _out(_run("ascend", TORCH_NPU_DIR, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert "AUTO portable\n" in out, out
    assert ("REFUSED Buffer: backend='ascend' is not available: torch_npu is installed but fails to import: its "
            "shared library libhccl.so is missing (it comes from Huawei's Ascend Extension for PyTorch (pip install "
            "torch-npu) with CANN's libraries; ImportError: libhccl.so: cannot open shared object file") in out, out


def test_cambricon_without_torch_mlu_names_torch_mlu():
    assert backends.unavailable_reason("cambricon") == ("torch_mlu is not installed (it comes from Cambricon's "
                                                        "PyTorch extension (Cambricon's SDK images, with Neuware))")
    out = _out(_run("cambricon", ""))
    assert "AUTO portable\n" in out and "REFUSED Buffer: backend='cambricon' is not available: torch_mlu is not " \
        "installed" in out, out


def test_ascend_without_torch_npu_names_torch_npu():
    assert backends.unavailable_reason("ascend").startswith("torch_npu is not installed (it comes from Huawei's "
                                                            "Ascend Extension for PyTorch")
