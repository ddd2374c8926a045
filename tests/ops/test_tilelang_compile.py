"""Every TileLang program compiles for NVIDIA sm_90 and sm_100 (the fast tier: sm_90), here, without a GPU.

The tests run the CPU build (target ``c``); this lowers each variant the CUDA wrappers launch to CUDA C++
and compiles it with nvcc (``tools/tilelang_cuda_check.py``): no spills, shared memory within one block's
limit. Compiled only: nothing built for the GPU runs here.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from helpers.paths import ROOT
from helpers.tiers import exhaustive

pytest.importorskip("tilelang", reason="tilelang does not import: install moe-comm[tilelang]")

TOOL = ROOT / "tools" / "tilelang_cuda_check.py"


# the fast tier compiles for sm_90 only (each architecture takes 40-80 s of nvcc on the 2-core test machine)
@pytest.mark.parametrize("arch", ["sm_90", exhaustive("sm_100", id="sm_100")])
def test_every_program_compiles(arch):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: the CUDA toolkit is not on PATH")
    child = subprocess.run([sys.executable, str(TOOL), "--arch", arch], capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    assert " 0 failed" in child.stdout
    other = next(a for a in ("sm_90", "sm_100") if a != arch)
    assert child.stdout.count(f"{arch} ") >= 10 and f"{other} " not in child.stdout, child.stdout
