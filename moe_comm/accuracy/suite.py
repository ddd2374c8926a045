"""Every op of ``moe_comm.ops`` on every device and implementation present, against the standard of
``moe_comm.accuracy``: ``python -m moe_comm.accuracy [--json PATH]`` prints one table and exits 1 if
any check fails.

Inputs are generated on the CPU from a fixed seed (normal data; ragged routing with unrouted slots
and an expert that receives nothing), copied to the device, and each result is checked against the
op's reference computed on the CPU. Triton on CPU tensors needs its interpreter, which Triton reads
at import; so when this process was not started with ``TRITON_INTERPRET=1`` the interpreter column
comes from a child process that was.

Exit status: 0 every check passes, 1 a check fails, 2 the interpreter child failed or cannot run (its
exception, traceback tail and Triton version are printed after the table of the rows that did run).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import ops
from ..ops import impl as impls
from .standard import EXACT, check

__all__ = ["run", "main", "targets", "InterpreterChildError"]

Check = tuple[str, torch.Tensor, torch.Tensor, Any]  # (what, out, ref, dtype or EXACT)


def _routing(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    """Random top-k without repeats; a few unrouted slots; expert 1 receives nothing."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :topk]
    idx[idx == 1] = -1
    idx[torch.rand(tokens, topk, generator=g) < 0.1] = -1
    return idx


def _normal(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _fields(what: str, out: Any, ref: Any, names: list[str]) -> Iterator[Check]:
    for name in names:
        yield f"{what}.{name}", getattr(out, name), getattr(ref, name), EXACT


def _formats(op: str, impl: str, cases: tuple) -> tuple:
    """The cases (format first) of ``op`` that ``impl`` has code for (TileLang: ``impls.tilelang_covers``)."""
    return tuple(case for case in cases if impl != "tilelang" or impls.tilelang_covers(op, case[0]))


def case_layout(device: torch.device, impl: str) -> Iterator[Check]:
    topk = _routing(96, 32, 6, seed=1)
    out = ops.dispatch_layout(topk.to(device), 4, 32, impl=impl)
    yield from _fields("layout", out, ops.dispatch_layout_reference(topk, 4, 32),
                       ["num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"])


_PERMUTATION = ["x", "scales", "expert_offsets", "num_tokens_per_expert", "row_of", "source", "expert_of_row"]


def case_permute(device: torch.device, impl: str) -> Iterator[Check]:
    x, topk = _normal(45, 256, seed=2), _routing(45, 8, 3, seed=3)
    for (quant,) in _formats("permute", impl, ((None,), ("e4m3",), ("int8",))):
        for alignment in (1, 16):
            out = ops.permute(x.to(device), topk.to(device), 8, alignment=alignment, quant=quant, impl=impl)
            ref = ops.permute_reference(x, topk, 8, alignment=alignment, quant=quant)
            names = _PERMUTATION if quant else [n for n in _PERMUTATION if n != "scales"]
            yield from _fields(f"permute[{quant or 'bf16'},align={alignment}]", out, ref, names)


def case_quantize(device: torch.device, impl: str) -> Iterator[Check]:
    x = _normal(33, 512, seed=4)
    for fmt, round_scale, ue8m0 in _formats("quantize", impl, (("e4m3", False, False), ("e4m3", True, False),
                                                               ("e4m3", True, True), ("e5m2", False, False),
                                                               ("int8", False, False))):
        name = f"quantize[{fmt}{',pow2' if round_scale else ''}{',ue8m0' if ue8m0 else ''}]"
        q, scales = ops.quantize(x.to(device), fmt, round_scale=round_scale, use_ue8m0=ue8m0, impl=impl)
        q_ref, scales_ref = ops.quantize_reference(x, fmt, round_scale=round_scale, use_ue8m0=ue8m0)
        yield f"{name}.codes", q, q_ref, EXACT
        yield f"{name}.scales", scales, scales_ref, EXACT
        back = ops.dequantize(q, scales, torch.float32, impl=impl)
        yield f"{name}.dequantize", back, ops.dequantize_reference(q_ref, scales_ref, torch.float32), EXACT
        yield f"{name}.roundtrip", back, x.double(), ops.FORMATS[fmt]


def case_unpermute(device: torch.device, impl: str) -> Iterator[Check]:
    topk = _routing(40, 8, 4, seed=5)
    perm = ops.permute_reference(_normal(40, 192, seed=6), topk, 8, alignment=4)
    weights = torch.rand(40, 4, generator=torch.Generator().manual_seed(7))
    y = _normal(perm.x.shape[0], 192, seed=8)
    ref = ops.unpermute_reduce_reference(y, perm.row_of, weights)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = ops.unpermute_reduce(y.to(device), perm.row_of.to(device), weights.to(device), out_dtype=out_dtype,
                                   impl=impl)
        yield f"unpermute_reduce[{str(out_dtype).replace('torch.', '')}]", out, ref, out_dtype


def _fp8_weights(experts: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights with random 128x128 block scales (as checkpoints ship them)."""
    w = _normal(experts, n, k, seed=seed, dtype=torch.float32, scale=100.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(experts, -(-n // 128), k // 128, generator=torch.Generator().manual_seed(seed + 1)) / 1000
    return w, scales + 1e-4


def case_grouped_gemm(device: torch.device, impl: str) -> Iterator[Check]:
    experts, k, n = 4, 256, 160
    topk = _routing(50, experts, 2, seed=9)
    perm = ops.permute_reference(_normal(50, k, seed=10), topk, experts, alignment=8)
    b = _normal(experts, n, k, seed=11, scale=k ** -0.5)
    out = ops.grouped_gemm(perm.x.to(device), b.to(device), expert_offsets=perm.expert_offsets.to(device),
                           impl=impl)
    yield "grouped_gemm[contiguous,bf16]", out, ops.grouped_gemm_reference(
        perm.x, b, expert_offsets=perm.expert_offsets), torch.bfloat16
    a3, masked_m = _normal(experts, 24, k, seed=12), torch.tensor([24, 0, 7, 13], dtype=torch.int32)
    out = ops.grouped_gemm(a3.to(device), b.to(device), masked_m=masked_m.to(device), impl=impl)
    yield "grouped_gemm[masked,bf16]", out, ops.grouped_gemm_reference(a3, b, masked_m=masked_m), torch.bfloat16
    a8, a_scales = ops.quantize_reference(perm.x, "e4m3")
    b8, b_scales = _fp8_weights(experts, n, k, seed=13)
    out = ops.grouped_gemm(a8.to(device), b8.to(device), expert_offsets=perm.expert_offsets.to(device),
                           a_scales=a_scales.to(device), b_scales=b_scales.to(device), impl=impl)
    yield "grouped_gemm[contiguous,fp8]", out, ops.grouped_gemm_reference(
        a8, b8, expert_offsets=perm.expert_offsets, a_scales=a_scales, b_scales=b_scales), torch.bfloat16


def case_expert_ffn(device: torch.device, impl: str) -> Iterator[Check]:
    experts, hidden, inter = 4, 256, 128
    topk = _routing(40, experts, 2, seed=14)
    perm = ops.permute_reference(_normal(40, hidden, seed=15), topk, experts, alignment=8)
    w13 = _normal(experts, 2 * inter, hidden, seed=16, scale=hidden ** -0.5)
    w2 = _normal(experts, hidden, inter, seed=17, scale=inter ** -0.5)
    offsets = perm.expert_offsets
    out = ops.expert_ffn(perm.x.to(device), w13.to(device), w2.to(device), expert_offsets=offsets.to(device),
                         impl=impl)
    yield "expert_ffn[bf16]", out, ops.expert_ffn_reference(perm.x, w13, w2, expert_offsets=offsets), torch.bfloat16
    x8, x_scales = ops.quantize_reference(perm.x, "e4m3")
    (w13_8, w13_s), (w2_8, w2_s) = _fp8_weights(experts, 2 * inter, hidden, 18), _fp8_weights(experts, hidden, inter, 20)
    fp8 = dict(x_scales=x_scales, w13_scales=w13_s, w2_scales=w2_s)
    out = ops.expert_ffn(x8.to(device), w13_8.to(device), w2_8.to(device), expert_offsets=offsets.to(device),
                         impl=impl, **{key: value.to(device) for key, value in fp8.items()})
    yield "expert_ffn[fp8]", out, ops.expert_ffn_reference(x8, w13_8, w2_8, expert_offsets=offsets, **fp8), \
        torch.float8_e4m3fn


CASES: dict[str, Callable[[torch.device, str], Iterator[Check]]] = {
    "dispatch_layout": case_layout, "permute": case_permute, "quantize": case_quantize,
    "unpermute_reduce": case_unpermute, "grouped_gemm": case_grouped_gemm, "expert_ffn": case_expert_ffn,
}


def targets(wanted: Sequence[str] = impls.IMPLS) -> list[tuple[torch.device, str]]:
    """(device, impl) pairs this process can run, of the implementations ``wanted``: CPU native, CPU Triton
    (interpreter), CPU TileLang (target ``c``), and each on CUDA. TileLang is imported only when wanted."""
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    usable = {"native": lambda device: (True, ""), "triton": ops.triton_usable, "tilelang": impls.tilelang_usable}
    return [(device, name) for device in devices for name in impls.IMPLS
            if name in wanted and usable[name](device)[0]]


def run(pairs: list[tuple[torch.device, str]]) -> list[dict[str, Any]]:
    """One row per check: op, check, device, impl, standard, metrics, passed, reason."""
    rows = []
    for device, name in pairs:
        for op, case in CASES.items():
            if name == "tilelang" and not impls.tilelang_covers(op):
                continue
            for what, out, ref, dtype in case(device, name):
                report = check(what, out, ref, dtype, raise_on_fail=False)
                rows.append({"op": op, "check": what, "device": device.type,
                             "impl": name + (" (interpreter)" if device.type == "cpu" and name == "triton" else ""),
                             "standard": report.standard, **report.metrics, "passed": report.passed,
                             "reason": report.reason})
    return rows


class InterpreterChildError(RuntimeError):
    """The ``TRITON_INTERPRET=1`` child of ``python -m moe_comm.accuracy`` produced no rows (or could not
    run: ``ops.impl.interpreter_problem``); the message carries its exit status, the Triton version and
    the tail of its stderr (its exception and traceback)."""


_CHILD_TIMEOUT_S = 1800
_STDERR_TAIL = 6000  # characters: a Triton interpreter traceback's last frames and its exception


def _triton_version() -> str:
    import triton  # imported already: ops.triton_usable found it
    return getattr(triton, "__version__", "unknown")


def _child_failure(how: str, stderr: str) -> InterpreterChildError:
    """The error naming the child's own: its last stderr line (a traceback's exception) first, then the tail."""
    tail = stderr[-_STDERR_TAIL:].rstrip() or "(nothing on stderr)"
    return InterpreterChildError(
        f"the Triton interpreter run (triton {_triton_version()}, TRITON_INTERPRET=1, "
        f"`{sys.executable} -m moe_comm.accuracy --only-cpu-triton`) {how}: {tail.splitlines()[-1]}\n"
        f"its stderr ends with:\n{tail}")


def _interpreter_rows() -> list[dict[str, Any]]:
    """Rows of a child process with ``TRITON_INTERPRET=1`` (Triton reads it once, at import). The child
    writes them to a file when its run is complete (stdout may carry a kernel's prints), so no file means
    it failed, whatever its exit status: raises InterpreterChildError with its own error."""
    if ops.triton_usable(torch.device("cpu"))[1].startswith("triton does not import"):
        return []
    if impls.interpreter_problem() is not None:
        raise InterpreterChildError(f"the Triton interpreter cannot run here: {impls.interpreter_problem()}")
    with tempfile.TemporaryDirectory(prefix="moe-comm-accuracy-") as tmp:
        path = os.path.join(tmp, "rows.json")
        command = [sys.executable, "-m", "moe_comm.accuracy", "--only-cpu-triton", "--rows-json", path]
        try:
            child = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
            raise _child_failure(f"did not finish within {_CHILD_TIMEOUT_S} s", stderr) from None
        if child.returncode < 0:
            how = f"was killed by {signal.Signals(-child.returncode).name}"
        elif child.returncode not in (0, 1):
            how = f"exited with status {child.returncode}"
        elif not os.path.exists(path):
            how = f"exited with status {child.returncode} without writing its rows"
        else:
            with open(path) as f:
                return json.load(f)
        raise _child_failure(how, child.stderr)


def _format(value: Any) -> str:
    return f"{value:.2e}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (numeric metrics for numeric checks, mismatched bytes for exact)."""
    columns = ["op", "check", "device", "impl", "standard", "calc_diff", "max_abs", "mare", "mere",
               "mismatched_bytes", "result"]
    cells = [[_format(row.get(c, "")) if c != "result" else ("pass" if row["passed"] else "FAIL: " + row["reason"])
              for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_comm.accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--no-interpreter", action="store_true",
                        help="skip Triton's CPU interpreter (before triton 3.7 it needs numpy<2.4)")
    parser.add_argument("--impl", nargs="+", choices=impls.IMPLS, default=list(impls.IMPLS),
                        help="only these implementations (default: every one present)")
    parser.add_argument("--only-cpu-triton", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    interpreter = (torch.device("cpu"), "triton")
    if args.only_cpu_triton:  # not targets(): importing TileLang installs TVM's own SIGSEGV handler
        pairs = [interpreter] if ops.triton_usable(interpreter[0])[0] else []
    else:
        pairs = targets(args.impl)
    if args.no_interpreter:
        pairs = [p for p in pairs if p != interpreter]
    rows = run(pairs)
    child_error = None
    if not (args.only_cpu_triton or args.no_interpreter) and "triton" in args.impl and interpreter not in pairs:
        try:
            rows += _interpreter_rows()
        except InterpreterChildError as exc:
            child_error = exc
    if args.rows_json:  # the child's side of _interpreter_rows: the file appears only once every row is in
        with open(args.rows_json + ".part", "w") as f:
            json.dump(rows, f)
        os.replace(args.rows_json + ".part", args.rows_json)
        return 0 if all(r["passed"] for r in rows) else 1
    print(table(rows))
    failed = sum(not r["passed"] for r in rows)
    covered = sorted({f"{r['device']}/{r['impl']}" for r in rows})
    print(f"\n{len(rows) - failed} of {len(rows)} checks pass on {', '.join(covered)}"
          + ("" if torch.cuda.is_available() else "; no CUDA device here, so no GPU rows"))
    if "tilelang" in args.impl and not args.only_cpu_triton:
        tilelang_ok, why = impls.tilelang_usable(torch.device("cpu"))
        if not tilelang_ok:
            print(f"no tilelang rows: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if child_error is not None:
        print(f"\npython -m moe_comm.accuracy: no cpu/triton (interpreter) rows: {child_error}", file=sys.stderr)
        return 2
    return 1 if failed else 0
