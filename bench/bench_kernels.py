"""Microbenchmark of the CPU kernels in ``moe_comm.ops``: ``_C`` at 1 and 2 threads vs the torch references.

    python bench/bench_kernels.py [--tokens 4096 --hidden 2048 --topk 8 --ranks 4 --experts 64]

A developer's benchmark (it times private entry points against the references that specify them),
so it stays in the repository; the user benchmarks ship as ``python -m moe_comm.bench``, whose
helpers this one shares.

Shapes are one rank's share of a dispatch/combine: ``tokens`` tokens routed by random top-k to
``ranks`` ranks. ``moe_comm.core.native.cpu_threads`` reads ``MOE_COMM_NUM_THREADS`` once per process,
so each thread count runs in a child process of this script; torch's intra-op threads (used by the
references) are set to the same count there.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from moe_comm.bench.record import write_json
from moe_comm.bench.stats import summarize, time_calls
from moe_comm.bench.table import format_table

BYTE_RULE = ("pack_rows: record bytes written; unpack_rows: record bytes read; combine_reduce: returned "
             "record bytes read (num_records x hidden x 2); dispatch_layout: topk_idx bytes read (T x K x 8). "
             "GB/s = bytes / median time / 1e9")


def _inputs(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank's dispatch/combine working set, as the portable backend builds it (``backends/portable/normal.py``)."""
    from moe_comm.ops.layout import plan_sends
    from moe_comm.ops import dispatch_layout_reference
    from moe_comm.ops.records import RecordLayout

    T, H, K, R, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["ranks"], cfg["experts"]
    torch.manual_seed(cfg["seed"])
    x = torch.randn(T, H).bfloat16()
    topk_idx = (torch.randn(T, E).abs() + 1).topk(K, dim=1).indices
    weights = torch.rand(T, K)
    src_idx = torch.arange(T, dtype=torch.int32).unsqueeze(1)
    plan = plan_sends(dispatch_layout_reference(topk_idx, R, E).is_token_in_rank)
    disp = RecordLayout.build([("x", x.dtype, H), ("topk_idx", torch.int64, K), ("topk_weights", torch.float32, K),
                               ("src_idx", torch.int32, 1)])
    num_records = plan.send_rows.shape[0]
    outs = [torch.empty(num_records, H, dtype=x.dtype), torch.empty(num_records, K, dtype=torch.int64),
            torch.empty(num_records, K), torch.empty(num_records, 1, dtype=torch.int32)]
    comb = RecordLayout.build([("x", x.dtype, H)])
    # combine input: the records returned to this rank, one per (token, rank) it sent
    returned = torch.randn(num_records, H).bfloat16().view(torch.uint8).view(num_records, comb.record_bytes)
    return dict(x=x, topk_idx=topk_idx, fields=[x, topk_idx, weights, src_idx], plan=plan, disp=disp, outs=outs,
                comb=comb, returned=returned, out=torch.empty(T, H, dtype=x.dtype))


def _cases(d: dict[str, Any], cfg: dict[str, Any]) -> list[tuple[str, str, Callable[[], Any], int]]:
    """(op, impl, call, bytes by BYTE_RULE) for every timed row."""
    from moe_comm import ops
    from moe_comm.ops import combine_reduce as reduction, records as record_ops
    from moe_comm.core.native import cpu_threads, native
    from moe_comm.ops.records import _segments  # internal: lets pack_rows write into a reused buffer

    R, E, disp, plan = cfg["ranks"], cfg["experts"], d["disp"], d["plan"]
    records = record_ops.pack_rows(disp, d["fields"], plan.send_rows)
    reused, copy_src = torch.empty_like(records), records.clone()
    segs, rows = _segments(disp, d["fields"]), plan.send_rows.contiguous()
    n, rb, combine_args = rows.shape[0], disp.record_bytes, (d["comb"], d["returned"], plan.send_pos, None, None,
                                                              d["out"], None)
    return [
        ("pack_rows", "_C", lambda: record_ops.pack_rows(disp, d["fields"], rows), records.numel()),
        ("pack_rows", "reference", lambda: record_ops.pack_rows_reference(disp, d["fields"], rows), records.numel()),
        # pack_rows allocates its output; this row reuses one, to separate first-touch page faults
        # of a fresh multi-MB allocation from the copy itself
        ("pack_rows", "_C_reused_out", lambda: native().pack_rows(reused.data_ptr(), segs, rows.data_ptr(), n, rb,
                                                                  cpu_threads()), records.numel()),
        ("unpack_rows", "_C", lambda: record_ops.unpack_rows(disp, records, d["outs"]), records.numel()),
        ("unpack_rows", "reference", lambda: record_ops.unpack_rows_reference(disp, records, d["outs"]),
         records.numel()),
        ("combine_reduce", "_C", lambda: reduction.combine_reduce(*combine_args), d["returned"].numel()),
        ("combine_reduce", "reference", lambda: reduction.combine_reduce_reference(*combine_args),
         d["returned"].numel()),
        ("dispatch_layout", "_C", lambda: ops.dispatch_layout(d["topk_idx"], R, E), d["topk_idx"].numel() * 8),
        ("dispatch_layout", "reference", lambda: ops.dispatch_layout_reference(d["topk_idx"], R, E),
         d["topk_idx"].numel() * 8),
        # measured ceiling: torch copy_ of the dispatch records' bytes between reused buffers
        ("memcpy_ceiling", "torch", lambda: reused.copy_(copy_src), records.numel()),
    ]


def _expect(ok: bool, what: str) -> None:
    if not ok:  # not an assert: must also hold under python -O
        raise RuntimeError(f"bench_kernels: _C and reference disagree on {what}; refusing to time it")


def _check(d: dict[str, Any], cfg: dict[str, Any]) -> None:
    """``_C`` output == reference output (bitwise), so nothing broken gets timed."""
    from moe_comm import ops
    from moe_comm.ops import combine_reduce as reduction, records as record_ops

    plan, disp, R, E = d["plan"], d["disp"], cfg["ranks"], cfg["experts"]
    got = record_ops.pack_rows(disp, d["fields"], plan.send_rows)
    want = record_ops.pack_rows_reference(disp, d["fields"], plan.send_rows)
    for f in disp.fields:  # bytes between fields are unspecified
        _expect(torch.equal(got[:, f.offset:f.offset + f.nbytes], want[:, f.offset:f.offset + f.nbytes]), f"pack {f.name}")
    ref_outs = [torch.empty_like(t) for t in d["outs"]]
    record_ops.unpack_rows(disp, got, d["outs"])
    record_ops.unpack_rows_reference(disp, got, ref_outs)
    _expect(all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(d["outs"], ref_outs)), "unpack")
    ref_out = torch.empty_like(d["out"])
    reduction.combine_reduce(d["comb"], d["returned"], plan.send_pos, None, None, d["out"], None)
    reduction.combine_reduce_reference(d["comb"], d["returned"], plan.send_pos, None, None, ref_out, None)
    _expect(torch.equal(d["out"].view(torch.int16), ref_out.view(torch.int16)), "combine_reduce")
    a, b = ops.dispatch_layout(d["topk_idx"], R, E), ops.dispatch_layout_reference(d["topk_idx"], R, E)
    _expect(all(torch.equal(getattr(a, n), getattr(b, n)) for n in
                ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")), "dispatch_layout")


def child(cfg: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    """Times every op at ``threads`` threads (env already set by the parent); one row per (op, impl)."""
    from moe_comm.core.native import cpu_threads

    torch.set_num_threads(threads)
    _expect(cpu_threads() == threads, f"thread count (cpu_threads()={cpu_threads()}, wanted {threads})")
    d = _inputs(cfg)
    _check(d, cfg)
    rows = []
    for op, impl, fn, nbytes in _cases(d, cfg):
        secs = time_calls(fn, cfg["warmup"], cfg["iters"])
        # rows an op walks: records, except dispatch_layout, which walks tokens
        n = cfg["tokens"] if op == "dispatch_layout" else d["plan"].send_rows.shape[0]
        rows.append({"op": op, "impl": impl, "threads": threads, "rows": n,
                     "bytes": nbytes, **summarize(secs), "times_us": [s * 1e6 for s in secs]})
    return rows


def run_threads(argv: Sequence[str], threads: int) -> list[dict[str, Any]]:
    """Runs this script as a child with ``threads`` threads; returns its rows."""
    env = dict(os.environ, MOE_COMM_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", str(threads)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_kernels: child with {threads} thread(s) failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(rows: list[dict[str, Any]], cfg: dict[str, Any], json_path: str) -> None:
    """Adds ratios, prints the table, writes JSON."""
    key = {(r["op"], r["impl"], r["threads"]): r for r in rows}
    for r in rows:
        r["GBps"] = r["bytes"] / (r["median_us"] * 1e-6) / 1e9
        ref = key.get((r["op"], "reference", r["threads"]))
        one = key.get((r["op"], r["impl"], 1))
        r["vs_reference"] = ref["median_us"] / r["median_us"] if r["impl"].startswith("_C") and ref else None
        r["vs_1thread"] = one["median_us"] / r["median_us"] if one else None
        r["p10_p90"] = f"{r['p10_us']:.0f}/{r['p90_us']:.0f}"
    order = list(dict.fromkeys(r["op"] for r in rows))
    impls = ["_C", "_C_reused_out", "reference", "torch"]
    rows.sort(key=lambda r: (order.index(r["op"]), impls.index(r["impl"]), r["threads"]))
    columns = [("op", "op"), ("impl", "impl"), ("threads", "threads"), ("rows", "rows"),
               ("median_us", "median_us"), ("p10_p90", "p10/p90_us"), ("GBps", "GB/s"),
               ("vs_reference", "speedup_vs_ref(x)"), ("vs_1thread", "speedup_vs_1thread(x)")]
    print(f"tokens={cfg['tokens']} hidden={cfg['hidden']} bf16 topk={cfg['topk']} ranks={cfg['ranks']} "
          f"experts={cfg['experts']}; one process, {os.cpu_count()} CPU cores")
    print(format_table(columns, rows))
    print(f"\nbytes: {BYTE_RULE}")
    for r in rows:
        r.pop("p10_p90")
    write_json(json_path, {"bench": "bench_kernels", "command": " ".join([Path(sys.executable).name] + sys.argv),
                           "config": cfg, "byte_rule": BYTE_RULE,
                           "timing": "perf_counter around one call, single process; stats over iterations",
                           "notes": ["speedup_vs_ref = reference median / _C median at the same thread count",
                                     "speedup_vs_1thread = same impl's 1-thread median / this median",
                                     "pack_rows _C_reused_out: native().pack_rows into a preallocated buffer "
                                     "(pack_rows allocates a fresh one per call); memcpy_ceiling: torch copy_ "
                                     "of the same bytes between preallocated buffers",
                                     "each thread count runs in its own process (MOE_COMM_NUM_THREADS is read once); "
                                     "torch.set_num_threads is set to the same count for the references",
                                     "shared, noisy VM"],
                           "results": rows})
    print(f"wrote {json_path}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to compare")
    p.add_argument("--json", default=str(Path(__file__).resolve().parent / "out" / "bench_kernels.json"))
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # internal: run one thread count
    args = p.parse_args(argv)
    if args.experts % args.ranks:
        raise SystemExit(f"bench_kernels: --experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    cfg = {k: getattr(args, k) for k in ("tokens", "hidden", "topk", "ranks", "experts", "warmup", "iters", "seed")}
    if args.child:
        print(json.dumps(child(cfg, args.child)))
        return
    passthrough = [f"--{k}={v}" for k, v in cfg.items()]
    rows = [row for n in args.threads for row in run_threads(passthrough, n)]
    report(rows, cfg, args.json)


if __name__ == "__main__":
    main()
