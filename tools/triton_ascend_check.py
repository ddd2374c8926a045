"""Check that moe_comm's Triton kernels get through triton-ascend's front end (Ascend A2/A3).

Run inside the isolated venv made by ``make ascend-check`` (triton-ascend 3.2.0 + numpy +
pybind11; no torch, no CANN, no NPU). The folder ``moe_comm/ops/triton`` is loaded by file path as
one package (its modules import only triton and each other), and every kernel variant in
``REGISTRY`` is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("npu",
"Ascend910B3", 0))`` in a forked child, with a fresh ``TRITON_CACHE_DIR`` (``--keep-cache`` keeps
the TTIR and ``.ttadapter`` files).

What a pass proves: the kernel parses and type-checks under triton-ascend's patched
``triton.language`` (so A2/A3 dtype rules such as "no fp8" apply), lowers to TTIR, and
triton-adapter-opt lowers that TTIR to the Linalg/HIVM MLIR (``.ttadapter``) -- the compile
stops only at the binary stage (bishengir-compile, which needs CANN: ``ASCEND_HOME_PATH is
not set``).

What it does not prove (necessary, not sufficient): nothing of bishengir-compile runs, so there
is no UB-overflow (192 KB on-chip buffer), coreDim <= 65535, alignment or code-generation check,
and nothing runs or is compared numerically. Several dtype rules documented for A2/A3 (atomic_add
on i64, atomic_cas on bf16, fp16 tl.dot results, fp64, uint16/32/64) are not rejected by the
front end. The script looks for these in the TTIR and in the signature and lists them as ``warn:``
in the detail column. The warnings do not change the exit status.

Exit status: 0 when every variant expected to pass reached the binary stage and every expected
failure failed as expected (its ``xfail`` text appears in the error). 1 otherwise (this includes
an unexpected pass and a Triton kernel in the modules that is in neither REGISTRY nor NOT_KERNELS).
2 when the harness itself is broken (the canary kernel failed, or the kernel folder is missing).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

KERNEL_DIR = Path(__file__).resolve().parents[1] / "moe_comm" / "ops" / "triton"
_PKG = "_ascend_check_kernels"
FP8 = "unexpected type fp8."  # triton_patch/language/core.py, dtype_to_ir, unless Ascend 950


@dataclass(frozen=True)
class Variant:
    """One compile of one kernel.

    ``signature`` maps every runtime argument to a type string, written as triton-ascend 3.2's
    ASTSource expects them ("*bf16", "*fp32", "*i32", "*u8", "*i8", "*fp8e4nv", "i32", "i64",
    "fp32", "i1"). ``constants`` maps every tl.constexpr argument to its value. Constexprs with
    defaults may be left out. A runtime argument given here as well is specialised (this entry wins),
    for example None for an absent optional pointer. ``xfail`` is text expected in the rejection.
    """

    name: str
    signature: dict[str, str]
    constants: dict[str, Any] = field(default_factory=dict)
    xfail: str | None = None
    reason: str = ""


def _sig(spec: str) -> dict[str, str]:
    """``"a_ptr:*bf16 n:i32"`` -> ``{"a_ptr": "*bf16", "n": "i32"}``."""
    return dict(item.split(":") for item in spec.split())


_NO_FP8 = "no fp8 dtype on A2/A3 (Ascend 950 only)"
_SYNTH = "not a shipped launch: the FP8 path with bf16/uint8 data, so its scale math is checked"

# Types and constexprs as the wrappers in moe_comm/ops/*.py launch them (Python int -> i32, float -> fp32,
# None -> a constant). Shapes: DeepSeek-V3-like, 256 experts on 8 ranks, top-8, hidden 7168.
_ROWS = _sig("x_ptr:*bf16 source_ptr:*i64 hidden:i32 source_div:i32 amax_floor:fp32 q_max:fp32 q_max_inv:fp32")
_ROWS_C = {"HAS_SOURCE": True, "ROUND_SCALE": False, "UE8M0": False, "BLOCK_H": 1024, "GROUPS": 8}
_GEMM = _sig("tile_expert_ptr:*i64 tile_start_ptr:*i64 tile_end_ptr:*i64 num_tiles:i32 N:i32 K:i32 b_rows:i32")
_GEMM_C = {"SWIGLU": False, "DOT_FP32": False, "BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}  # GPU defaults
_BF16_AB = {**_GEMM, **_sig("a_ptr:*bf16 b_ptr:*bf16 c_ptr:*bf16")}
_FP8_AB = {**_GEMM, **_sig("a_ptr:*fp8e4nv b_ptr:*fp8e4nv c_ptr:*bf16 a_scales_ptr:*fp32 b_scales_ptr:*fp32")}
_NO_SCALES = {"a_scales_ptr": None, "b_scales_ptr": None}

# "<file stem>.<kernel>" -> variants. Pick constexpr values that a caller really uses.
REGISTRY: dict[str, tuple[Variant, ...]] = {
    "layout.dispatch_layout_kernel": (
        Variant("K8 R8 E256", _sig("topk_ptr:*i64 per_rank_ptr:*i32 per_expert_ptr:*i32 in_rank_ptr:*u8 num_tokens:i32"),
                {"NUM_TOPK": 8, "NUM_RANKS": 8, "EXPERTS_PER_RANK": 32, "BLOCK_T": 128}),
    ),
    "permute.block_histogram_kernel": (
        Variant("E256", _sig("topk_ptr:*i64 counts_ptr:*i32 num_items:i32"), {"NUM_EXPERTS": 256, "BLOCK": 128}),
    ),
    "permute.permute_index_kernel": (
        Variant("E256", _sig("topk_ptr:*i64 block_base_ptr:*i64 row_of_ptr:*i64 source_ptr:*i64 "
                             "expert_of_row_ptr:*i32 num_items:i32"), {"NUM_EXPERTS": 256, "BLOCK": 128}),
    ),
    "quant.rows_kernel": (
        Variant("copy bf16", {**_ROWS, **_sig("out_ptr:*bf16")}, {**_ROWS_C, "QUANT": 0, "scales_ptr": None}),
        Variant("int8", {**_ROWS, **_sig("out_ptr:*i8 scales_ptr:*fp32")}, {**_ROWS_C, "QUANT": 2}),
        Variant("int8 no source", {**_ROWS, **_sig("out_ptr:*i8 scales_ptr:*fp32")},
                {**_ROWS_C, "QUANT": 2, "HAS_SOURCE": False, "source_ptr": None}),
        Variant("e4m3", {**_ROWS, **_sig("out_ptr:*fp8e4nv scales_ptr:*fp32")},
                {**_ROWS_C, "QUANT": 1, "BLOCK_H": 1024}, FP8, _NO_FP8),
        Variant("e5m2 ue8m0", {**_ROWS, **_sig("out_ptr:*fp8e5 scales_ptr:*u8")},
                {**_ROWS_C, "QUANT": 1, "ROUND_SCALE": True, "UE8M0": True, "BLOCK_H": 1024}, FP8, _NO_FP8),
        Variant("fp8 math, bf16 out*", {**_ROWS, **_sig("out_ptr:*bf16 scales_ptr:*fp32")},
                {**_ROWS_C, "QUANT": 1, "BLOCK_H": 1024}, reason=_SYNTH),
        Variant("fp8 math ue8m0, bf16 out*", {**_ROWS, **_sig("out_ptr:*bf16 scales_ptr:*u8")},
                {**_ROWS_C, "QUANT": 1, "ROUND_SCALE": True, "UE8M0": True, "BLOCK_H": 1024}, reason=_SYNTH),
    ),
    "quant.dequant_kernel": (
        Variant("int8 -> bf16", _sig("q_ptr:*i8 scales_ptr:*fp32 out_ptr:*bf16 hidden:i32"),
                {"QUANT": 2, "UE8M0": False, "BLOCK_H": 1024, "GROUPS": 8}),
        Variant("e4m3 -> bf16", _sig("q_ptr:*fp8e4nv scales_ptr:*fp32 out_ptr:*bf16 hidden:i32"),
                {"QUANT": 1, "UE8M0": False, "BLOCK_H": 1024, "GROUPS": 8}, FP8, _NO_FP8),
        Variant("e5m2 ue8m0 -> bf16", _sig("q_ptr:*fp8e5 scales_ptr:*u8 out_ptr:*bf16 hidden:i32"),
                {"QUANT": 1, "UE8M0": True, "BLOCK_H": 1024, "GROUPS": 8}, FP8, _NO_FP8),
        Variant("fp8 math ue8m0, u8 in*", _sig("q_ptr:*u8 scales_ptr:*u8 out_ptr:*bf16 hidden:i32"),
                {"QUANT": 1, "UE8M0": True, "BLOCK_H": 1024, "GROUPS": 8}, reason=_SYNTH),
    ),
    "unpermute.unpermute_reduce_kernel": (
        Variant("bf16", _sig("y_ptr:*bf16 row_of_ptr:*i64 weights_ptr:*fp32 out_ptr:*bf16 hidden:i32"),
                {"NUM_TOPK": 8, "BLOCK_H": 1024}),
        Variant("fp32", _sig("y_ptr:*fp32 row_of_ptr:*i64 weights_ptr:*fp32 out_ptr:*fp32 hidden:i32"),
                {"NUM_TOPK": 8, "BLOCK_H": 1024}),
    ),
    "grouped_gemm.grouped_gemm_kernel": (
        Variant("bf16", _BF16_AB, {**_GEMM_C, **_NO_SCALES, "FP8": False, "BLOCK_N": 256, "BLOCK_K": 64}),
        Variant("bf16 swiglu", _BF16_AB, {**_GEMM_C, **_NO_SCALES, "FP8": False, "SWIGLU": True, "BLOCK_K": 64}),
        Variant("e4m3", _FP8_AB, {**_GEMM_C, "FP8": True, "BLOCK_K": 128}, FP8, _NO_FP8),
        Variant("e4m3 swiglu", _FP8_AB, {**_GEMM_C, "FP8": True, "SWIGLU": True, "BLOCK_K": 128}, FP8, _NO_FP8),
        Variant("fp8 scales swiglu, bf16 ab*", {**_BF16_AB, **_sig("a_scales_ptr:*fp32 b_scales_ptr:*fp32")},
                {**_GEMM_C, "FP8": True, "SWIGLU": True, "BLOCK_K": 128}, reason=_SYNTH),
    ),
}

# "<file stem>.<function>" -> why it is not compiled on its own. Helpers (a @triton.jit function that
# another one in the folder calls) are skipped without being listed: they compile inside their callers.
NOT_KERNELS: dict[str, str] = {}


@triton.jit
def _canary_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


CANARY = Variant("u8", {"x_ptr": "*u8", "y_ptr": "*u8", "out_ptr": "*u8", "n": "i32"}, {"BLOCK": 1024})


@dataclass
class Row:
    kernel: str
    variant: str
    result: str
    detail: str
    ok: bool


# A2/A3 restrictions that triton-ascend documents but its front end lets through.
_RES = r".*->\s*(?:tensor<(?:\d+x)*)?"  # the result type of an op in TTIR
_LINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"tt\.atomic_rmw f?add, " + _RES + r"(i64|f64)\b"), "atomic_add on {0}"),
    (re.compile(r"tt\.atomic_cas " + _RES + r"(bf16|f64)\b"), "atomic_cas on {0}"),
    (re.compile(r"tt\.atomic_(?:rmw \w+|cas), (?!acq_rel, gpu,)(\w+, \w+),"), "atomic sem/scope {0}"),
    (re.compile(r"tt\.dot " + _RES + r"(f16|i8)>"), "tl.dot result {0}"),
    (re.compile(r"\b(f64)\b"), "{0} values"),
)


def _lint(ttir: str, signature: dict[str, str]) -> list[str]:
    found = {msg.format(*m.groups()) for line in ttir.splitlines() for rx, msg in _LINTS if (m := rx.search(line))}
    found |= {f"{ty} argument" for ty in signature.values() if ty.lstrip("*") in ("u16", "u32", "u64", "fp64")}
    return sorted(found)


def _error_line(e: BaseException, width: int = 150) -> str:
    """The first informative line of a compile error, at most ``width`` characters (plus the source line)."""
    cut = lambda text: text if len(text) <= width else text[:width - 3] + "..."  # noqa: E731
    msg = getattr(e, "error_message", None)  # triton.compiler.errors.CompilationError
    if msg:
        line = cut(msg.strip().splitlines()[0])
        lineno, src = getattr(getattr(e, "node", None), "lineno", None), getattr(e, "src", None)
        if src and lineno:
            line += f" @ `{src.splitlines()[lineno - 1].strip()[:60]}`"
        return line
    lines = [s.strip() for s in str(e).splitlines() if s.strip() and not s.strip().startswith(("///", "[INFO]"))]
    stage = getattr(e, "stage_name", None)
    if stage:  # MLIRCompilationError: "[Stage] encounters error:", then the tool's stderr
        body = lines[1:] or [""]
        for marker in ("error: ", "Assertion "):
            hits = [s[s.index(marker):] for s in body if marker in s]
            if hits:
                return cut(f"[{stage}] {hits[0]}")
        return cut(f"[{stage}] {body[0]}")
    return cut(f"{type(e).__name__}: {lines[0] if lines else ''}")


def _compile_child(fn: JITFunction, v: Variant, arch: str, conn: Any) -> None:
    out = {"stage": None, "error": "", "cache": ""}
    with contextlib.redirect_stdout(io.StringIO()):  # "ERROR: Invalid bishengir path format" noise
        try:
            triton.compile(ASTSource(fn=fn, signature=v.signature, constants=v.constants),
                           target=GPUTarget("npu", arch, 0))
            out["stage"] = "done"
        except Exception as e:  # noqa: BLE001 -- every failure is a result here
            out["stage"] = getattr(e, "stage_name", None) or type(e).__name__
            out["error"] = _error_line(e)
            m = re.search(r"compiled kernel cache is in (\S+)", str(e))
            out["cache"] = m.group(1) if m else ""
    conn.send(out)
    conn.close()


def _normalise(fn: JITFunction, v: Variant) -> Variant | str:
    """Order the signature by argument position and fill constexpr defaults; or say what is wrong."""
    consts = dict(v.constants)
    for p in fn.params:
        if p.is_constexpr and p.name not in consts and p.has_default:
            consts[p.name] = p.default
    given = set(v.signature) | set(consts)
    missing = [a for a in fn.arg_names if a not in given]
    unknown = sorted(given - set(fn.arg_names))
    runtime_const = [p.name for p in fn.params if p.is_constexpr and p.name in v.signature]
    if missing or unknown or runtime_const:
        return f"registry does not match the kernel: missing={missing} unknown={unknown} " \
               f"constexpr in signature={runtime_const}"
    sig = {a: v.signature[a] for a in fn.arg_names if a in v.signature and a not in consts}
    return Variant(v.name, sig, consts, v.xfail, v.reason)


def check(kernel: str, fn: JITFunction, v: Variant, arch: str, timeout: float) -> Row:
    nv = _normalise(fn, v)
    if isinstance(nv, str):
        return Row(kernel, v.name, "registry error", nv, False)
    recv, send = mp.Pipe(duplex=False)
    child = mp.get_context("fork").Process(target=_compile_child, args=(fn, nv, arch, send))
    child.start()
    send.close()
    out = None
    with contextlib.suppress(EOFError):  # EOF: the child died without sending
        out = recv.recv() if recv.poll(timeout) else None
    child.join(5)
    if out is None:
        child.kill()
        child.join()
        why = f"exit code {child.exitcode}" if child.exitcode not in (None, -9) else f"no result in {timeout:.0f} s"
        return Row(kernel, nv.name, "front end crashed", why, False)
    stem = Path(out["cache"] or "/nonexistent", fn.__name__[:150])  # the cache names files by kernel
    adapter, ttir_file = stem.with_suffix(".ttadapter"), stem.with_suffix(".ttir")
    if out["stage"] == "done" or (out["stage"] == "ConvertLinalgRToBinary" and adapter.is_file()):
        ttir = ttir_file.read_text() if ttir_file.is_file() else ""
        if out["stage"] == "done":
            detail = "compiled to npubin"
        else:
            why = out["error"].split("] ", 1)[-1]
            why = "no CANN" if "ASCEND_HOME_PATH is not set" in why else why
            detail = f"TTIR + .ttadapter ({adapter.stat().st_size // 1024} KB); stops at npubin: {why}"
        warns = _lint(ttir, nv.signature)
        if warns:
            detail = "warn: " + ", ".join(warns) + "; " + detail
        if nv.xfail is not None:
            return Row(kernel, nv.name, "unexpected pass", f"expected `{nv.xfail}` ({nv.reason}); {detail}", False)
        return Row(kernel, nv.name, "front end ok", detail, True)
    err = out["error"]
    if nv.xfail is not None and nv.xfail in err:
        return Row(kernel, nv.name, "expected failure", f"{err} -- {nv.reason}" if nv.reason else err, True)
    note = f" (expected `{nv.xfail}`)" if nv.xfail is not None else ""
    return Row(kernel, nv.name, "front end rejects", err + note, False)


def load_kernels(kernel_dir: Path) -> tuple[dict[str, JITFunction], dict[str, str], list[Row]]:
    """Every @triton.jit function defined in the folder's modules, the helpers among them (called by
    another one), and load errors. The folder is loaded by path as one package, for relative imports."""
    init = kernel_dir / "__init__.py"
    spec = importlib.util.spec_from_file_location(_PKG, init, submodule_search_locations=[str(kernel_dir)])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[_PKG] = package
    try:
        if init.is_file():
            spec.loader.exec_module(package)
    except Exception as e:  # noqa: BLE001
        return {}, {}, [Row(init.name, "-", "load error", f"{type(e).__name__}: {e}".splitlines()[0], False)]
    found: dict[str, JITFunction] = {}
    rows: list[Row] = []
    for path in sorted(kernel_dir.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{_PKG}.{path.stem}")
        except Exception as e:  # noqa: BLE001
            rows.append(Row(path.name, "-", "load error", f"{type(e).__name__}: {e}".splitlines()[0], False))
            continue
        for obj in vars(module).values():
            while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):  # autotune / heuristics
                obj = obj.fn
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
                found[f"{path.stem}.{obj.__name__}"] = obj
    helpers: dict[str, str] = {}
    for key, fn in found.items():
        call = re.compile(rf"(?<![\w.]){re.escape(fn.__name__)}\s*\(")
        callers = [k for k, g in found.items() if k != key and call.search(g.src)]
        if callers:
            helpers[key] = f"helper, called from {', '.join(callers)}"
    return found, helpers, rows


def run(kernel_dir: Path, arch: str, timeout: float) -> tuple[list[Row], int]:
    canary = check("(canary) _canary_add", _canary_add, CANARY, arch, timeout)
    if not canary.ok:
        return [canary], 2
    if not kernel_dir.is_dir():
        return [canary, Row(str(kernel_dir), "-", "missing", "kernel folder not found", False)], 2
    found, helpers, rows = load_kernels(kernel_dir)
    rows.insert(0, canary)
    for key in sorted(set(found) | set(REGISTRY) | set(NOT_KERNELS)):
        if key in REGISTRY and key in found:
            rows += [check(key, found[key], v, arch, timeout) for v in REGISTRY[key]]
        elif key in REGISTRY or (key in NOT_KERNELS and key not in found):
            rows.append(Row(key, "-", "registry error", "no such @triton.jit function", False))
        elif key in NOT_KERNELS or key in helpers:
            rows.append(Row(key, "-", "skipped", NOT_KERNELS.get(key) or helpers[key], True))
        else:
            rows.append(Row(key, "-", "not in registry", "add its variants to REGISTRY or NOT_KERNELS", False))
    return rows, 0 if all(r.ok for r in rows) else 1


def print_table(rows: list[Row]) -> None:
    cols = ("kernel", "variant", "result", "detail")
    cells = [cols] + [(r.kernel, r.variant, r.result, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    for i, c in enumerate(cells):
        print(" | ".join(s.ljust(w) for s, w in zip(c[:3], widths)) + " | " + c[3])
        if i == 0:
            print("-+-".join("-" * w for w in widths) + "-+-" + "-" * 6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--arch", default="Ascend910B3", help="GPUTarget arch (default: %(default)s)")
    ap.add_argument("--kernel-dir", type=Path, default=KERNEL_DIR)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per compile")
    ap.add_argument("--keep-cache", action="store_true", help="keep the Triton cache folder (TTIR, .ttadapter)")
    args = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="triton-ascend-check-")
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        rows, status = run(args.kernel_dir, args.arch, args.timeout)
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    print_table(rows)
    if any(r.variant.endswith("*") for r in rows):
        print(f"* {_SYNTH}")
    verdict = {0: "all as expected", 1: "FAILED", 2: "HARNESS BROKEN"}[status]
    print(f"\ntriton-ascend {triton.__version__}, target npu/{args.arch}: {verdict}"
          + (f"; cache kept in {cache}" if args.keep_cache else ""))
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "arch": args.arch, "status": status,
                                         "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
