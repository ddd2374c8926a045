"""Compile every TileLang program variant for NVIDIA sm_90 (H100/H200) and sm_100 (B200), without a GPU.

Each variant the wrappers launch (``moe_comm/ops/tilelang_launch.py``: the tiles of ``gemm_tiles`` for
CUDA) is lowered by TileLang to CUDA C++ (``moe_comm.ops.tilelang.build.cuda_source``) and compiled by nvcc
to a cubin for ``sm_90a``/``sm_100a`` with TileLang's headers (its CUTLASS copy and ``tl_templates``), with
``ptxas -v``. A variant passes when nvcc succeeds, ptxas reports no spill stores or loads, and the dynamic
shared memory TileLang planned fits one block's opt-in limit (227 KiB on sm_90 and sm_100).

    python tools/tilelang_cuda_check.py            # exit 0: every variant compiled within budget
    python tools/tilelang_cuda_check.py --keep DIR # also keep each .cu and the ptxas report in DIR
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

ARCHS = ("sm_90", "sm_100")
SHARED_LIMIT = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 and sm_100


class Variant(NamedTuple):
    name: str
    program: Callable[..., Any]
    params: tuple


def variants() -> list[Variant]:
    """Every (program, parameters) the CUDA wrappers build, at DeepSeek-V3-like sizes (hidden 7168, expert
    intermediate 2048, 8 of 256 experts on this rank)."""
    from moe_comm.ops.tilelang import grouped_gemm, rows, unpermute
    from moe_comm.ops.tilelang_launch import gemm_tiles
    hidden, inter, experts = 7168, 2048, 8
    found = [
        Variant("rows copy bf16", rows.rows_program, (hidden, "bfloat16", None, False, False)),
        Variant("rows e4m3", rows.rows_program, (hidden, "bfloat16", "float8_e4m3", False, False)),
        Variant("rows e4m3 pow2 ue8m0", rows.rows_program, (hidden, "bfloat16", "float8_e4m3", True, True)),
        Variant("rows e5m2", rows.rows_program, (hidden, "bfloat16", "float8_e5m2", False, False)),
        Variant("dequant e4m3", rows.dequant_program, (hidden, "float8_e4m3", "bfloat16", False)),
        Variant("unpermute bf16", unpermute.unpermute_program, (hidden, 8, "bfloat16", "bfloat16")),
    ]
    for fp8 in (False, True):
        dtype = "float8_e4m3" if fp8 else "bfloat16"
        for swiglu in (False, True):
            n, k = (inter, hidden) if swiglu else (hidden, inter)
            found.append(Variant(f"grouped_gemm {'fp8' if fp8 else 'bf16'}{' swiglu' if swiglu else ''}",
                                 grouped_gemm.gemm_program,
                                 (n, k, experts, 2 * n if swiglu else n, dtype, "bfloat16", fp8, swiglu,
                                  *gemm_tiles("cuda", fp8, swiglu))))
    return found


def include_dirs() -> list[str]:
    import tilelang.env
    return [tilelang.env.CUTLASS_INCLUDE_DIR, tilelang.env.TILELANG_TEMPLATE_PATH]


def compile_one(variant: Variant, arch: str, nvcc: str, keep: Path | None) -> tuple[bool, str]:
    """(passed, one line: registers, spills, shared memory, or the error)."""
    from moe_comm.ops.tilelang.build import cuda_source
    try:
        source, device_mod = cuda_source(variant.program, arch, *variant.params)
    except Exception as exc:  # noqa: BLE001 - a lowering failure is this variant's result
        return False, f"TileLang lowering failed: {type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"
    shared = max((int(f.attrs["dyn_shared_memory_buf"]) for f in device_mod.functions.values()
                  if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs), default=0)
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "kernel.cu"
        cu.write_text(source)
        command = [nvcc, "-std=c++20", "-w", "-O3", "--cubin", "-gencode", f"arch=compute_{arch[3:]}a,code={arch}a",
                   *(f"-I{d}" for d in include_dirs()), "-Xptxas", "-v", "-o", str(Path(tmp) / "kernel.cubin"), str(cu)]
        child = subprocess.run(command, capture_output=True, text=True, timeout=600)
        report = child.stdout + child.stderr
        if keep is not None:
            stem = f"{variant.name.replace(' ', '_')}.{arch}"
            shutil.copy(cu, keep / f"{stem}.cu")
            (keep / f"{stem}.ptxas.txt").write_text(report)
    if child.returncode != 0:
        return False, "nvcc failed: " + " | ".join(line for line in report.splitlines() if "error" in line)[:400]
    used = re.findall(r"Used (\d+) registers", report)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    line = f"{max(map(int, used), default=0)} registers, {sum(spills)} spill bytes, {shared} B dynamic shared memory"
    return not any(spills) and shared <= SHARED_LIMIT, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="keep each variant's .cu and ptxas report in this folder")
    parser.add_argument("--arch", choices=ARCHS, action="append", help="only this architecture (repeatable; "
                        "default: every one)")
    args = parser.parse_args(argv)
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if nvcc is None or not os.path.exists(nvcc):
        print("nvcc not found: put the CUDA toolkit's bin on PATH or set CUDA_HOME")
        return 2
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    failed = total = 0
    for variant in variants():
        for arch in args.arch or ARCHS:
            passed, line = compile_one(variant, arch, nvcc, args.keep)
            total += 1
            failed += not passed
            print(f"{'ok  ' if passed else 'FAIL'} {variant.name:28s} {arch:7s} {line}", flush=True)
    print(f"{total - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
