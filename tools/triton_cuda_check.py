"""Compile every Triton kernel variant for an NVIDIA Hopper GPU (sm_90), without a GPU.

Triton's CPU interpreter runs kernels without compiling them, so it accepts code the compiler
rejects (a plain int global read inside a kernel, for one). This compiles each variant listed in
``tools/triton_ascend_check.py``'s REGISTRY with the installed Triton's NVIDIA back end down to a
cubin (``ptxas`` ships in the triton wheel). Run it with Triton's interpreter off: Triton decides
at import whether its own library functions are compiled or interpreted.

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


def source(fn: triton.runtime.jit.JITFunction, variant: registry.Variant) -> ASTSource:
    """The variant as an ASTSource of this Triton (3.2 took ``constants`` by name; 3.3+ takes
    ``constexprs`` by argument index, with "constexpr" in the signature)."""
    full = registry._normalise(fn, variant)
    if isinstance(full, str):
        raise ValueError(full)
    if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
        return ASTSource(fn=fn, signature=full.signature, constants=full.constants)
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in full.constants:
            signature[name], constexprs[(i,)] = "constexpr", full.constants[name]
        else:
            signature[name] = full.signature[name]
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def main() -> int:
    found, _, errors = registry.load_kernels(registry.KERNEL_DIR)
    failed = [f"{row.kernel}: {row.detail}" for row in errors]
    compiled = 0
    for kernel, variants in registry.REGISTRY.items():
        for variant in variants:
            try:
                binary = triton.compile(source(found[kernel], variant), target=TARGET)
                assert binary.asm.get("cubin"), "no cubin"
                compiled += 1
            except Exception as exc:  # noqa: BLE001 -- every failure is reported
                failed.append(f"{kernel}[{variant.name}]: {' '.join(str(exc).split())[:400]}")
    print(f"triton {triton.__version__}, cuda sm_90: {compiled} variants compiled, {len(failed)} failed")
    print("\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
