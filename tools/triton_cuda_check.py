"""Compile every Triton kernel variant for an NVIDIA Hopper GPU (sm_90), without a GPU.

Triton's CPU interpreter runs kernels without compiling them, so it accepts code the compiler
rejects (a plain int global read inside a kernel, for one). This compiles each variant listed in
``tools/triton_ascend_check.py``'s REGISTRY with the installed Triton's NVIDIA back end down to a
cubin (``ptxas`` ships in the triton wheel), as the wrappers launch it:

- with the launch options they pass (the grouped GEMM's ``default_config``: warps, stages, and tile
  sizes, which the registry must match; ``enable_fp_fusion=False`` for the rows kernel, as
  ``moe_comm/ops/quant.py`` launches it; Triton's defaults for the other kernels);
- twice: for any sizes, and specialised as Triton's JIT specialises a launch whose pointers are
  16-byte aligned and whose integer arguments are multiples of 16 (DeepSeek-V3's shapes). Only the
  second form lets the compiler vectorise the loads and software-pipeline the GEMM's K loop into
  ``num_stages`` shared-memory buffers, so only it shows the shared memory a real launch asks for.

Each compile must fit the 227 KiB of shared memory that one sm_90 block may have, or the launch
would fail on the GPU with "out of resource". Variants that are not shipped launches (the
registry's ``_SYNTH`` ones) are compiled but not held to that limit.
Run it with Triton's interpreter off: Triton decides at import whether its own library functions
are compiled or interpreted.

    TRITON_INTERPRET=0 python tools/triton_cuda_check.py      # exit 0: every variant compiled
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_ascend_check as registry  # noqa: E402  (the one list of kernel variants)

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (H100, H200)
GEMM = "grouped_gemm.grouped_gemm_kernel"
# Launch options of the other kernels that are not Triton's defaults (round_int8 needs an unfused add).
FIXED_OPTIONS = {"quant.rows_kernel": {"enable_fp_fusion": False}}


def source(fn: triton.runtime.jit.JITFunction, variant: registry.Variant, aligned: bool = False) -> ASTSource:
    """The variant as an ASTSource of this Triton (3.2 took ``constants`` by name; 3.3+ takes
    ``constexprs`` by argument index, with "constexpr" in the signature). ``aligned`` marks every
    pointer and integer argument divisible by 16, as the JIT does for such a launch."""
    full = registry._normalise(fn, variant)
    if isinstance(full, str):
        raise ValueError(full)
    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        return ASTSource(fn=fn, signature=full.signature, constants=full.constants)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in full.constants:
            signature[name], constexprs[(i,)] = "constexpr", full.constants[name]
            continue
        signature[name] = full.signature[name]
        if aligned and (signature[name].startswith("*") or signature[name] in ("i32", "i64")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def launch_options(kernel: str, variant: registry.Variant) -> dict[str, int | bool]:
    """The wrapper's launch options: the GEMM's ``num_warps``/``num_stages``, FIXED_OPTIONS for the others;
    raises if the registry's GEMM tiles differ from ``moe_comm.ops.grouped_gemm.default_config`` (the
    registry would then check a launch nobody makes)."""
    if kernel != GEMM:
        return dict(FIXED_OPTIONS.get(kernel, {}))
    from moe_comm.ops.grouped_gemm import default_config
    c = variant.constants
    config = default_config(c["FP8"], c["SWIGLU"], interpreting=False)
    tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
             "GROUP_M": config.group_m}
    if any(c.get(name) != value for name, value in tiles.items()):
        raise ValueError(f"registry tiles {({n: c.get(n) for n in tiles})} differ from default_config {tiles}")
    return {"num_warps": config.num_warps, "num_stages": config.num_stages}


def main() -> int:
    found, _, errors = registry.load_kernels(registry.KERNEL_DIR)
    failed = [f"{row.kernel}: {row.detail}" for row in errors]
    compiled, lines = 0, []
    for kernel, variants in registry.REGISTRY.items():
        for variant in variants:
            for aligned in (False, True):
                form = f"{kernel}[{variant.name}]{' aligned' if aligned else ''}"
                try:
                    options = launch_options(kernel, variant)
                    binary = triton.compile(source(found[kernel], variant, aligned), target=TARGET, options=options)
                    assert binary.asm.get("cubin"), "no cubin"
                    shared = binary.metadata.shared
                    if shared > SHARED_LIMIT and variant.reason != registry._SYNTH:
                        raise ValueError(f"needs {shared} B of shared memory, sm_90 allows {SHARED_LIMIT}")
                    compiled += 1
                    lines.append(f"  {form}: {options or 'triton defaults'}, shared {shared} B")
                except Exception as exc:  # noqa: BLE001 -- every failure is reported
                    failed.append(f"{form}: {' '.join(str(exc).split())[:400]}")
    print(f"triton {triton.__version__}, cuda sm_90: {compiled} compiles passed (two forms per variant), "
          f"{len(failed)} failed")
    print("\n".join(lines + failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
