"""Reading what nvcc and ptxas make of the CUDA kernels: the nvcc to use, ptxas's per-kernel register and
spill report, and the launch bounds in the PTX (shared by the device-build and NVSHMEM-build tests)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

REGISTER_FILE = 65536  # 32-bit registers per SM on sm_90 and sm_100
MAX_REGISTERS = 255    # per thread


def _nvcc() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


NVCC = _nvcc()


def short_name(mangled: str) -> str:
    """``..._24ll_combine_reduce_kernelENS1_5Batch...`` -> ``ll_combine_reduce_kernel``; a template
    kernel's ``..._15ll_post_kernelINS1_5BatchI...LowLatencyCombineArgsEE...`` ->
    ``ll_post_kernel[LowLatencyCombineArgs]`` (its arguments' struct)."""
    template = re.search(r"([a-z_]+_kernel)I.*?\d(LowLatency(?:Dispatch|Combine)Args|NoArgs)E", mangled)
    if template:
        return f"{template.group(1).lstrip('_')}[{template.group(2)}]"
    found = re.findall(r"[a-z_]+_kernel(?=E)", mangled)
    return found[-1].lstrip("_") if found else mangled


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Per kernel: registers, spill stores/loads and stack frame bytes, from ``-Xptxas -v`` output."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = kernels.setdefault(short_name(m.group(1)), {})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
            current = None
    return kernels


def launch_bounds(ptx: str) -> dict[str, tuple[int, int]]:
    """Per kernel: (threads per block, min blocks per SM) from the PTX's .maxntid / .minnctapersm
    (what __launch_bounds__ compiles to); (0, 0) when a kernel has none."""
    bounds: dict[str, tuple[int, int]] = {}
    for m in re.finditer(r"\.entry\s+(\S+?)\s*\((.*?)\)\s*(.*?)\{", ptx, re.S):
        directives = m.group(3)
        ntid = re.search(r"\.maxntid\s+(\d+(?:\s*,\s*\d+)*)", directives)  # "256, 1, 1" or "256"
        blocks = re.search(r"\.minnctapersm\s+(\d+)", directives)
        threads = 0
        if ntid:
            threads = 1
            for n in ntid.group(1).split(","):
                threads *= int(n)
        bounds[short_name(m.group(1))] = (threads, int(blocks.group(1)) if blocks else 1)
    return bounds
