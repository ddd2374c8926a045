"""Benchmark of the fused MoE ops in ``moe_comm.ops`` against the device's measured ceilings and torch baselines.

    python -m moe_comm.bench ops                                 # CUDA when available, else CPU; sizes per device
    python -m moe_comm.bench ops --device cpu --reps 5           # tokens 512, hidden 2048, I 256, 64 experts, top-8
    python -m moe_comm.bench ops --device cuda --tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8
    python -m moe_comm.bench ops --tokens 128 512 2048 --plot ops.png

    TRITON_INTERPRET=1 python -m moe_comm.bench ops --device cpu --tokens 64 --hidden 512 --experts 8 \
        --intermediate 128                                       # with Triton's interpreter beside TileLang

One process, one device. Shapes are one EP rank's share: ``tokens`` tokens routed by random top-k
over the ``experts`` local experts. Every op runs each of our backends ("native"; "tilelang" where it
has a program; "triton" on CUDA, and on the CPU in its interpreter when TRITON_INTERPRET=1 is set) next
to torch baselines and two ceilings measured in the same run (a large tensor copy, one dense bf16
matmul). ``first_s`` is each of our rows' first call, untimed otherwise: for TileLang the compile (its
cache is a fresh folder per run), for Triton's interpreter none. Every output is checked against a torch
baseline before anything is timed; a backend of ours that disagrees stops the run, so no number is published for a wrong kernel.
Prints a table per token count, the byte and FLOP rules and the ceilings; writes one JSON record.
``--ranks`` shapes dispatch_layout only (experts map to ranks in contiguous blocks).
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .ops_baselines import GROUP, TOL
from .ops_cases import BYTE_RULE, FLOP_RULE, Group, build_groups, ceiling_cases, inputs
from .options import add_output_args, add_tokens_arg, command_line
from .plot import Panel, Series
from .record import publish
from .stats import summarize, time_calls
from .table import format_table

__all__ = ["run", "panels", "main"]

#: Sizes per device: one EP rank's share at DeepSeek-V3 scale on CUDA; on CPU small enough that the
#: whole run takes about a minute on two cores (bf16 matmul there runs at ~0.02 TFLOP/s).
DEFAULTS = {
    "cuda": dict(tokens=4096, hidden=7168, intermediate=2048, experts=32, topk=8, ranks=8, alignment=128,
                 warmup=3, reps=20),
    "cpu": dict(tokens=512, hidden=2048, intermediate=256, experts=64, topk=8, ranks=8, alignment=32,
                warmup=1, reps=5),
}
NOTES = [
    "vs_torch = the fastest complete torch baseline's median in the same op and case / this median",
    "torch_loop*: per-expert matmuls with the expert bounds already on the host (no device read timed)",
    "torch_index_copy: the row copy alone with precomputed indices (not a complete permute; no vs_torch)",
    "torch_grouped_mm masked: one 3-D grouped_mm over all E*M rows; TFLOP/s still counts valid rows only",
    "permute native_unfused: ops.permute then ops.quantize on the same backend (what the fused pass saves)",
    "checks: data movement bitwise; float results calc_diff < TOL against a torch baseline, or an fp32 "
    "reference of the op's contract for FP8 GEMM and the FFN",
]


def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int,
            flush: Optional[torch.Tensor]) -> list[float]:
    """Seconds per call. CUDA: events around each call (ops that sync the host inside still measure
    end to end), with L2 flushed before each so inputs come from HBM as in a real layer; CPU: perf_counter."""
    if device.type != "cuda":
        return time_calls(fn, warmup, reps)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e-3 for start, end in events]


def _reason(e: BaseException) -> str:
    """An exception as a short table note: its first sentence."""
    return f"n/a: {type(e).__name__}: {str(e).splitlines()[0].split('. ')[0]}"[:100]


def check(groups: list[Group]) -> list[dict[str, Any]]:
    """Runs every impl once against its group's baseline. Ours disagreeing or failing: error. A torch
    baseline that fails or disagrees: its row becomes 'n/a' with the reason. Returns the check records."""
    records, broken = [], []
    for g in groups:
        want = g.want()
        for c in g.cases:
            if c.fn is None:
                continue
            try:
                start = time.perf_counter()
                got = c.fn()
                if c.ours:
                    c.first_s = time.perf_counter() - start
            except NotImplementedError as e:  # a backend that declines a case says so; not a wrong result
                c.fn, c.note = None, _reason(e)
                continue
            except Exception as e:  # noqa: BLE001 -- a torch baseline unsupported on this device/dtype
                if c.ours:
                    raise
                c.fn, c.note = None, _reason(e)
                continue
            ok, what = g.compare(got, want)
            records.append({"op": g.op, "case": g.case, "impl": c.impl, "ok": ok, "check": what})
            if not ok and c.ours:
                broken.append(f"{g.op} [{g.case}] {c.impl}: {what}")
            elif not ok:
                c.fn, c.note = None, f"n/a: disagrees with the baseline ({what})"
        del want
    if broken:
        raise SystemExit("ops: our outputs disagree with the torch baselines; refusing to time them:\n  "
                         + "\n  ".join(broken))
    return records


def run(cfg: dict[str, Any], device: torch.device, backends: Sequence[str]
        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Checks, then times, the ceilings and every case; returns (rows, check records, the masked
    layout's rows per expert M)."""
    d = inputs(cfg, device)
    ceilings = ceiling_cases(cfg, device, d["valid"])
    groups = build_groups(d, cfg, backends)
    records = check(groups)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    rows = []
    for c in ceilings + [c for g in groups for c in g.cases]:
        row = {"op": c.op, "case": c.case, "impl": c.impl, "unit": c.unit, "work": c.work, "ours": c.ours,
               "full": c.full, "note": c.note, "first_s": c.first_s}
        if c.fn is not None:
            secs = time_fn(c.fn, device, cfg["warmup"], cfg["reps"], flush)
            stats = summarize(secs)
            row.update(stats, rate=c.work / (stats["median_us"] * 1e-6) / (1e9 if c.unit == "GB/s" else 1e12),
                       times_us=[s * 1e6 for s in secs])
        rows.append(row)
    return rows, records, d["M"]


def add_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """``pct_ceiling`` against this run's ceiling of the row's unit; ``vs_torch`` = the fastest complete
    torch baseline's median in the same (op, case) / this median. Returns the ceilings."""
    ceil = {r["unit"]: r["rate"] for r in rows if r["impl"] in ("copy", "matmul_bf16")}
    for r in rows:
        if "median_us" not in r:
            continue
        r["pct_ceiling"] = 100.0 * r["rate"] / ceil[r["unit"]]
        if r["op"] == "ceiling":
            continue
        base = [b["median_us"] for b in rows if (b["op"], b["case"]) == (r["op"], r["case"]) and not b["ours"]
                and b["full"] and "median_us" in b]
        r["vs_torch"] = min(base) / r["median_us"] if base else None
    return ceil



COLUMNS = [("op", "op"), ("case", "case"), ("impl", "impl"), ("median_us", "median_us"),
           ("p10_p90", "p10/p90_us"), ("rate", "rate"), ("unit", "unit"), ("pct_ceiling", "%ceiling"),
           ("vs_torch", "vs_torch(x)"), ("first_s", "first_s"), ("note", "note")]


def _report_run(rows: list[dict[str, Any]], records: list[dict[str, Any]], cfg: dict[str, Any], where: str,
                masked_m: int) -> dict[str, float]:
    """Prints one run's table, ceilings and checks; returns the ceilings."""
    ceil = add_ratios(rows)
    for r in rows:
        r["p10_p90"] = f"{r['p10_us']:.0f}/{r['p90_us']:.0f}" if "p10_us" in r else None
    print(f"== ops: {where}; tokens={cfg['tokens']} hidden={cfg['hidden']} intermediate={cfg['intermediate']} "
          f"experts={cfg['experts']} topk={cfg['topk']} ranks={cfg['ranks']} alignment={cfg['alignment']}; "
          f"masked M={masked_m}; warmup {cfg['warmup']}, reps {cfg['reps']}")
    print(format_table(COLUMNS, rows))
    for r in rows:
        r.pop("p10_p90", None)
    fp32 = next(r.get("rate") for r in rows if r["impl"] == "matmul_fp32")
    print(f"\nceilings (this run): memory {ceil['GB/s']:.1f} GB/s (copy); compute {ceil['TFLOP/s']:.3f} TFLOP/s "
          f"(bf16 matmul), the %ceiling of every GEMM row, FP8 included; fp32 matmul {fp32:.3f} TFLOP/s")
    diffs = [float(c["check"].split()[-1]) for c in records if c["check"].startswith("calc_diff")]
    print(f"checks before timing: {sum(c['ok'] for c in records)} of {len(records)} outputs agree with their torch "
          f"baseline (data movement exactly; float results calc_diff <= {max(diffs, default=0):.1e}, bound {TOL:g}); "
          f"JSON 'checks' has each\n")
    return {"memory_GBps": ceil["GB/s"], "bf16_matmul_TFLOPs": ceil["TFLOP/s"], "fp32_matmul_TFLOPs": fp32}


def panels(record: dict[str, Any]) -> list[Panel]:
    """The plot of a JSON record: one panel per (op, case), a line per implementation (ours solid, the
    torch baselines dotted), and the floor the run's ceiling sets for the panel's work: the copy's
    bandwidth (GB/s panels; the memory-copy floor) or the dense bf16 matmul's (TFLOP/s panels)."""
    by_group: dict[tuple[str, str], list[tuple[int, dict[str, Any], dict[str, float]]]] = {}
    for run in record["runs"]:
        for r in run["results"]:
            if r["op"] != "ceiling":
                by_group.setdefault((r["op"], r["case"]), []).append((run["tokens"], r, run["ceilings"]))
    out = []
    for (op, case), found in by_group.items():
        series = []
        for impl in dict.fromkeys(r["impl"] for _, r, _ in found):
            points = tuple(sorted((t, r["median_us"], r["rate"]) for t, r, _ in found
                                  if r["impl"] == impl and "median_us" in r))
            ours = any(r["ours"] for _, r, _ in found if r["impl"] == impl)
            if points:
                series.append(Series(impl, "ours" if ours else "baseline", points))
        unit = found[0][1]["unit"]
        ceiling, scale, label = (("memory_GBps", 1e9, "memory-copy floor") if unit == "GB/s" else
                                 ("bf16_matmul_TFLOPs", 1e12, "bf16 matmul ceiling"))
        work = {t: (r["work"], c[ceiling]) for t, r, c in found}
        series.append(Series(label, "floor", tuple(sorted((t, w / (rate * scale) * 1e6, rate)
                                                          for t, (w, rate) in work.items()))))
        out.append(Panel(f"{op} {case}", tuple(series), unit))
    return out


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """The options (``prog``: the command's name in usage and errors)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    add_tokens_arg(p, None, f"tokens of one EP rank (default: {DEFAULTS['cuda']['tokens']} on cuda, "
                            f"{DEFAULTS['cpu']['tokens']} on cpu)")
    for k in ("hidden", "intermediate", "experts", "topk", "ranks", "alignment", "warmup", "reps"):
        p.add_argument(f"--{k}", type=int, default=None, help=f"default: {DEFAULTS['cuda'][k]} on cuda, "
                                                               f"{DEFAULTS['cpu'][k]} on cpu")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "ops")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m moe_comm.bench ops") -> None:
    """Parses ``argv``, checks and times every case at each token count, prints, writes JSON (and the plot)."""
    args = parse_args(argv, prog)
    defaults = DEFAULTS[args.device]
    cfg = {k: v if (v := getattr(args, k, None)) is not None else d for k, d in defaults.items() if k != "tokens"}
    cfg["seed"] = args.seed
    tokens = args.tokens or [defaults["tokens"]]
    if cfg["hidden"] % GROUP or (2 * cfg["intermediate"]) % GROUP or cfg["experts"] % cfg["ranks"]:
        raise SystemExit(f"ops: --hidden ({cfg['hidden']}) and 2 x --intermediate ({2 * cfg['intermediate']}) "
                         f"must be multiples of {GROUP}, --experts ({cfg['experts']}) a multiple of --ranks "
                         f"({cfg['ranks']})")
    if cfg["reps"] < 1:
        raise SystemExit(f"ops: --reps must be >= 1, got {cfg['reps']}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ops: --device cuda, but torch sees no CUDA device")
    device = torch.device(args.device)
    if device.type == "cuda":  # the native GEMMs multiply in fp32: TF32 decides whether that uses tensor cores
        cfg["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    from moe_comm.ops import triton_usable
    from moe_comm.ops.impl import tilelang_usable

    backends, skipped = ["native"], []
    usable, why = triton_usable(device)
    if not usable:
        skipped.append(f"backend 'triton': {why}")
    else:
        backends.insert(0, "triton")
    usable, why = tilelang_usable(device)
    if not usable:
        skipped.append(f"backend 'tilelang': {why}")
    else:
        backends.append("tilelang")
        # first_s then shows each program's compile, not a load from an earlier run's cache.
        os.environ["TILELANG_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-comm-bench-tilelang-")
        atexit.register(shutil.rmtree, os.environ["TILELANG_CACHE_DIR"], True)
    for s in skipped:
        print(f"skipped: {s}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    runs = []
    for t in tokens:
        t0 = time.perf_counter()
        rows, records, masked_m = run({**cfg, "tokens": t}, device, backends)
        ceilings = _report_run(rows, records, {**cfg, "tokens": t}, where, masked_m)
        runs.append({"tokens": t, "masked_M": masked_m, "wall_s": round(time.perf_counter() - t0, 1),
                     "ceilings": ceilings, "checks": records, "results": rows})
    print(f"bytes: {BYTE_RULE}\nflops: {FLOP_RULE}")
    print("vs_torch: the fastest complete torch baseline of the same op and case / this median (>1: faster)")
    for s in skipped:
        print(f"skipped: {s}")
    record = {"bench": "ops", "command": command_line(prog, argv), "config": {**cfg, "tokens": tokens},
              "device": where, "byte_rule": BYTE_RULE, "flop_rule": FLOP_RULE,
              "timing": ("CUDA: events around each call, L2 flushed before each"
                         if device.type == "cuda" else "CPU: perf_counter around each call"),
              "notes": NOTES, "skipped": skipped, "runs": runs}
    print(f"wall time {sum(r['wall_s'] for r in runs):.1f} s")
    title = (f"fused MoE ops on {where}: hidden {cfg['hidden']}, intermediate {cfg['intermediate']}, "
             f"top-{cfg['topk']} of {cfg['experts']} experts")
    publish(record, args.json, args.plot, title, panels)
