"""Every Triton kernel compiles for an NVIDIA Hopper GPU (sm_90), here, without a GPU.

The CPU interpreter (which the other tests use) never runs Triton's compiler, so it accepts kernels
the compiler rejects. ``tools/triton_cuda_check.py`` compiles each registered variant to a cubin; it
runs in a child process because Triton, once imported with its interpreter on, cannot compile.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.paths import ROOT

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA back end")

TOOL = ROOT / "tools" / "triton_cuda_check.py"


def test_every_kernel_compiles_for_sm90():
    child = subprocess.run([sys.executable, str(TOOL)], env={**os.environ, "TRITON_INTERPRET": "0"},
                           capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    assert " 0 failed" in child.stdout
