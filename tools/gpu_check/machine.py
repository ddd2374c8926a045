"""Facts of the machine a GPU check ran on: GPU (nvidia-smi), driver, compute mode, torch and its CUDA,
the tools found (nvcc, compute-sanitizer), CPU count, Python.

    python tools/gpu_check/machine.py --json OUT.json
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys

import common  # noqa: F401  (import path)

QUERY = "name,driver_version,memory.total,compute_mode,clocks.max.sm,clocks.max.mem,power.limit,pcie.link.gen.max"


def run(cmd: list, timeout: float = 10.0) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


def find(tool: str) -> str | None:
    """``tool`` on PATH, in the CUDA toolkit's usual places, or in a pip nvidia package."""
    found = shutil.which(tool)
    if found:
        return found
    import glob
    import sysconfig
    roots = ["/usr/local/cuda/bin", *sorted(glob.glob("/usr/local/cuda-*/bin")), "/usr/local/cuda/compute-sanitizer",
             *sorted(glob.glob("/opt/nvidia/*/bin"))]
    site = sysconfig.get_paths()["purelib"]
    roots += sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin")))
    for r in roots:
        p = os.path.join(r, tool)
        if os.access(p, os.X_OK):
            return p
    return None


def facts() -> dict:
    out: dict = {"ok": True, "python": sys.version.split()[0], "platform": platform.platform(),
                 "cpu_count": os.cpu_count()}
    out["nvidia_smi"] = run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv"])
    out["nvidia_smi_topology"] = run(["nvidia-smi", "topo", "-m"])[:800]
    for tool in ("nvcc", "compute-sanitizer"):
        path = find(tool)
        out[tool] = {"path": path, "version": run([path, "--version"]).splitlines()[-2:] if path else None}
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                             "memory_GiB": round(p.total_memory / 2**30, 1), "count": torch.cuda.device_count()}
    except Exception as exc:  # noqa: BLE001 - a fact too
        out["torch"] = f"unavailable: {exc}"
        out["ok"] = False
    # versions from the installed distributions' metadata (importing cupy or numba would cost seconds)
    import importlib.metadata as md
    wanted = ("triton", "numpy", "cupy", "numba", "nvidia-nvshmem", "nvidia-nccl", "nvidia-cuda-runtime", "pytest",
              "scikit-build-core", "pybind11", "cmake", "ninja")
    found: dict = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if any(name == w or name.startswith(w + "-") for w in wanted):
            found[name] = dist.version
    out["packages"] = dict(sorted(found.items()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--find", default=None, metavar="TOOL", help="print where TOOL is (empty: nowhere), then exit")
    a = ap.parse_args(argv)
    if a.find:
        print(find(a.find) or "")
        return 0
    rec = common.Record(a.json, tool="machine")
    rec.check("facts", facts)
    for k, v in rec.data["checks"]["facts"].items():
        print(f"{k}: {v}")
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
