"""Benchmark of moe_comm._cuda's emulated ranks on one GPU, with DeepEP's shapes and byte formulas, and
the device's copy bandwidth measured in the same run.

- copy: ``dst.copy_(src)`` of 1 GiB (CUDA events, median of 10 after 3 warm-ups): ``copy_GBps`` = bytes
  copied per second; ``read_plus_write_GBps`` = twice that (what bench_ops records as the ceiling).
- normal mode, R emulated ranks in each launch (R = 8, then 4 and 2 while --budget-s allows): 4096
  tokens x 7168 hidden bf16 per rank, top-8 of 256 experts, DeepEP's 8-rank configs (dispatch: send
  chunk 6, 256 ring slots; combine: chunk 4, 256 slots), combine of the received rows (no weights),
  as DeepEP's test_intranode tunes them. Channels start at 10 (DeepEP's 20 SMs); a cooperative grid
  that cannot be co-resident fails to launch, and the run retries with fewer channels (``attempts``).
  Times per iteration with CUDA events: ``kernel`` = the dispatch (or combine) launch, ``call`` = the
  prologue (ring reset + barrier, DeepEP's cached-dispatch barrier) and the launch. Bytes: DeepEP's
  ``dispatch_bf16_nvl_recv_bytes`` (recv_x's bytes, per rank) for both (combine sends the same rows
  back). ``per_rank_GBps`` = a rank's bytes / median time (DeepEP's figure); ``aggregate_GBps`` = all R
  ranks' bytes / median time (one GPU moves all of them); ``of_copy`` = aggregate / copy_GBps.
  Outputs are checked (harness.semantics) before and after timing: broken ops are not timed.
- low latency, 8 emulated ranks: 128 tokens x 7168, top-8 of 256 experts, bf16 and FP8 dispatch; DeepEP's
  bench loop (256 MB L2 flush, events around each call, one synchronisation at the end), eager launches
  and CUDA-graph replays. Bytes as DeepEP's test_low_latency: per selection hidden*2 (bf16) or
  hidden + hidden/128*4 + 16 (FP8) for dispatch, hidden*2 for combine.

Targets (the issue's): normal ``of_copy`` >= 0.60; low-latency dispatch <= 40 us, combine <= 60 us.

    python tools/gpu_check/bench.py --json OUT.json [--budget-s 60]
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import common  # noqa: F401  (import path)
from harness import (EmulatedSide, LowLatencyCase, LowLatencyShape, NormalCase, NormalShape, ll_semantics,
                     low_latency_inputs, normal_inputs, semantics)

TARGETS = {"normal_of_copy_min": 0.60, "ll_dispatch_us_max": 40.0, "ll_combine_us_max": 60.0}
CHANNELS = (10, 8, 6, 5, 4, 3, 2, 1)


def stats(seconds: list) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    q = lambda p: us[min(len(us) - 1, max(0, round(p * (len(us) - 1))))]  # noqa: E731
    return {"median_us": statistics.median(us), "p10_us": q(0.1), "p90_us": q(0.9), "min_us": us[0],
            "iters": len(us)}


def segments(calls: list, warmup: int, iters: int, flush=None) -> list[list[float]]:
    """Seconds of each call of ``calls`` (run in turn) per timed iteration: CUDA events at every boundary,
    read after one synchronisation at the end (DeepEP's bench). ``flush`` runs untimed before each."""
    import torch
    for _ in range(warmup):
        for c in calls:
            c()
    torch.cuda.synchronize()
    marks = []
    for _ in range(iters):
        if flush is not None:
            flush()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        ev[0].record()
        for c, e in zip(calls, ev[1:]):
            c()
            e.record()
        marks.append(ev)
    torch.cuda.synchronize()
    return [[ev[i].elapsed_time(ev[i + 1]) / 1e3 for ev in marks] for i in range(len(calls))]


def copy_bandwidth(nbytes: int = 1 << 30, warmup: int = 3, iters: int = 10) -> dict:
    import torch
    buf = {"src": torch.ones(nbytes, dtype=torch.uint8, device="cuda")}
    buf["dst"] = torch.empty_like(buf["src"])
    t = stats(segments([lambda: buf["dst"].copy_(buf["src"])], warmup, iters)[0])
    buf.clear()
    torch.cuda.empty_cache()
    return {"ok": True, "bytes": nbytes, **t, "copy_GBps": nbytes / (t["median_us"] * 1e-6) / 1e9,
            "read_plus_write_GBps": 2 * nbytes / (t["median_us"] * 1e-6) / 1e9}


def _gpu_outputs(case: NormalCase) -> dict:
    return {r: {**case.notes[r], **case.outs[r]} for r in case.side.served}


def _too_large(exc: Exception):
    """(kernel, capacity) of a cooperative launch that cannot be co-resident, else None."""
    msg = str(exc)
    if "resident" not in msg and "CooperativeLaunchTooLarge" not in msg and "too large" not in msg.lower():
        return None
    cap = re.search(r"holds (-?\d+)", msg)
    kernel = "combine" if "combine" in msg else "dispatch" if "dispatch" in msg else "?"
    return kernel, int(cap.group(1)) if cap else -1


def normal_at(R: int, C: int, T: int, H: int, E: int, K: int, warmup: int, iters: int, timeout_s: float) -> dict:
    import torch
    s = NormalShape(R=R, C=C, L=E // R, H=H, T=T, K=K, chunk=6, combine_chunk=4, slots=256, fp8=False,
                    weights=False, seed=5)
    ins = normal_inputs(s, device="cuda")
    side = EmulatedSide(R, timeout_s)
    try:
        case = NormalCase(side, s, ins)
        case.notify()
        case.dispatch()
        case.prologue()
        case.combine()
        torch.cuda.synchronize()
        bad = semantics(ins, _gpu_outputs(case), s)
        if bad:
            return {"ok": False, "C": C, "error": "outputs wrong before timing: not timed", "mismatches": bad[:10]}
        d = segments([lambda: case.prologue(case.nd), case.dispatch], warmup, iters)
        c = segments([lambda: case.prologue(case.nc), case.combine], warmup, iters)
        bad = semantics(ins, _gpu_outputs(case), s)
        recv_bytes = [int(case.notes[r]["num_recv"]) * H * 2 for r in range(R)]
    finally:
        side.close()
        del side
        torch.cuda.empty_cache()
    out = {"ok": not bad, "C": C, "shape": s.__dict__, "recv_rows_per_rank": [b // (2 * H) for b in recv_bytes],
           "recv_bytes_per_rank_mean": statistics.mean(recv_bytes), "recv_bytes_all_ranks": sum(recv_bytes)}
    if bad:
        out["mismatches_after_timing"] = bad[:10]
    for name, (pro, kern) in (("dispatch", d), ("combine", c)):
        call = [a + b for a, b in zip(pro, kern)]
        row = {"kernel": stats(kern), "call": stats(call), "prologue": stats(pro)}
        for what in ("kernel", "call"):
            t = row[what]["median_us"] * 1e-6
            row[what]["per_rank_GBps"] = statistics.mean(recv_bytes) / t / 1e9
            row[what]["aggregate_GBps"] = sum(recv_bytes) / t / 1e9
        out[name] = row
    return out


def normal_bench(R: int, T: int, H: int, E: int, K: int, warmup: int, iters: int, timeout_s: float,
                 copy_GBps: float) -> dict:
    attempts = []
    C = CHANNELS[0]
    while C >= 1:
        try:
            res = normal_at(R, C, T, H, E, K, warmup, iters, timeout_s)
        except RuntimeError as exc:
            found = _too_large(exc)
            if found is None:
                raise
            kernel, cap = found
            blocks = (lambda c: 2 * c * R * R) if kernel == "dispatch" else (lambda c: (R + 1) * c * R)
            attempts.append({"C": C, "kernel": kernel, "blocks": blocks(C), "capacity": cap, "error": str(exc)[:400]})
            fits = [c for c in CHANNELS if c < C and (cap < 0 or blocks(c) <= cap)]
            if not fits:
                return {"ok": False, "attempts": attempts, "error": "no channel count fits co-resident"}
            C = fits[0]
            continue
        res["attempts"] = attempts
        res["channels_ran"] = C
        for name in ("dispatch", "combine"):
            if name in res and copy_GBps:
                for what in ("kernel", "call"):
                    res[name][what]["of_copy"] = res[name][what]["aggregate_GBps"] / copy_GBps
        return res
    return {"ok": False, "attempts": attempts}


def ll_bench(R: int, T: int, H: int, E: int, K: int, M: int, fmt: str, warmup: int, iters: int,
             timeout_s: float) -> dict:
    import torch
    s = LowLatencyShape(R=R, L=E // R, M=M, H=H, T=T, K=K, fmt=fmt, seed=6)
    ins = low_latency_inputs(s, device="cuda")
    side = EmulatedSide(R, timeout_s)
    flush_buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    out: dict = {"shape": s.__dict__}
    try:
        case = LowLatencyCase(side, s, ins)
        case.run()
        bad = ll_semantics(ins, case.outs, s)
        if bad:
            return {**out, "ok": False, "error": "outputs wrong before timing: not timed", "mismatches": bad[:10]}
        eager = segments([case.dispatch, case.combine], warmup, iters, flush=flush_buf.zero_)
        case.finish()  # error records of every launch so far
        out["eager"] = {"dispatch": stats(eager[0]), "combine": stats(eager[1])}
        try:
            gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            torch.cuda.synchronize()
            with torch.cuda.graph(gd, stream=stream):
                case.dispatch()
            with torch.cuda.graph(gc, stream=stream):
                case.combine()
            graph = segments([gd.replay, gc.replay], warmup, iters, flush=flush_buf.zero_)
            case.finish()
            out["graph"] = {"dispatch": stats(graph[0]), "combine": stats(graph[1])}
        except Exception as exc:  # noqa: BLE001 - eager numbers stand; graph.py is the graph check
            out["graph"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        bad = ll_semantics(ins, case.outs, s)
        selections = [int((ins[r]["topk"] >= 0).sum()) for r in range(R)]
    finally:
        side.close()
        del flush_buf
        torch.cuda.empty_cache()
    fp8 = fmt != "bf16"
    per_sel_d = (H + H // 128 * 4 + 16) if fp8 else 2 * H
    d_bytes, c_bytes = statistics.mean(selections) * per_sel_d, statistics.mean(selections) * 2 * H
    for mode in ("eager", "graph"):
        if "dispatch" in out.get(mode, {}):
            out[mode]["dispatch"]["per_rank_GBps"] = d_bytes / (out[mode]["dispatch"]["median_us"] * 1e-6) / 1e9
            out[mode]["combine"]["per_rank_GBps"] = c_bytes / (out[mode]["combine"]["median_us"] * 1e-6) / 1e9
    out.update(ok=not bad, selections_per_rank_mean=statistics.mean(selections), dispatch_bytes_per_rank=d_bytes,
               combine_bytes_per_rank=c_bytes)
    if bad:
        out["mismatches_after_timing"] = bad[:10]
    return out


def targets(data: dict) -> dict:
    """The issue's targets beside the numbers (None where the number is missing)."""
    checks = data["checks"]
    t: dict = {}
    n8 = checks.get("normal_R8", {})
    for op in ("dispatch", "combine"):
        v = n8.get(op, {}).get("call", {}).get("of_copy")
        k = n8.get(op, {}).get("kernel", {}).get("of_copy")
        t[f"normal_R8_{op}_of_copy"] = {"value": v, "kernel_only": k, "target": f">= {TARGETS['normal_of_copy_min']}",
                                        "met": None if v is None else v >= TARGETS["normal_of_copy_min"]}
    for fmt, op, key in (("fp8", "dispatch", "ll_dispatch_us_max"), ("bf16", "dispatch", "ll_dispatch_us_max"),
                         ("fp8", "combine", "ll_combine_us_max")):
        c = checks.get(f"ll_R8_{fmt}", {})
        v = c.get("eager", {}).get(op, {}).get("median_us")
        g = c.get("graph", {}).get(op, {}).get("median_us")
        t[f"ll_R8_{fmt}_{op}_us"] = {"value": v, "graph_replay": g, "target": f"<= {TARGETS[key]}",
                                     "met": None if v is None else v <= TARGETS[key]}
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="normal mode: tokens per rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--normal-ranks", type=int, nargs="+", default=[8, 4, 2],
                    help="emulated ranks of the normal-mode runs, in order (the first always runs)")
    ap.add_argument("--ll-tokens", type=int, default=128)
    ap.add_argument("--ll-ranks", type=int, default=8)
    ap.add_argument("--ll-formats", nargs="+", default=["fp8", "bf16"], choices=["bf16", "fp8", "fp8_ue8m0"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="start no optional run (normal R after the first) once this much time has passed")
    ap.add_argument("--timeout", type=float, default=30.0, help="kernel wait deadline, seconds")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rec = common.Record(a.json, tool="bench", targets_of_the_issue=TARGETS, args=vars(a))
    if not common.gpu_present():
        rec.check("gpu", lambda: {"ok": False, "error": "no CUDA device (torch.cuda.is_available() is False)"})
        return rec.finish()
    import torch
    rec.data["device"] = torch.cuda.get_device_name(0)
    copy = rec.check("copy", copy_bandwidth)
    copy_GBps = copy.get("copy_GBps", 0.0)
    t0 = time.perf_counter()
    runs = [("normal", a.normal_ranks[0])] + [("ll", f) for f in a.ll_formats] + \
        [("normal", R) for R in a.normal_ranks[1:]]
    for kind, what in runs:
        optional = kind == "normal" and what != a.normal_ranks[0]
        if optional and time.perf_counter() - t0 > a.budget_s:
            rec.data.setdefault("skipped", []).append(f"normal_R{what}: past --budget-s {a.budget_s}")
            continue
        if kind == "normal":
            rec.check(f"normal_R{what}", lambda R=what: normal_bench(R, a.tokens, a.hidden, a.experts, a.topk,
                                                                   a.warmup, a.iters, a.timeout, copy_GBps))
        else:
            rec.check(f"ll_R{a.ll_ranks}_{what}", lambda f=what: ll_bench(a.ll_ranks, a.ll_tokens, a.hidden,
                                                                         a.experts, a.topk, a.ll_tokens, f,
                                                                         a.warmup, a.iters, a.timeout))
        rec.data["targets"] = targets(rec.data)
        rec.save()
    rec.data["targets"] = targets(rec.data)
    print(report(rec.data), flush=True)
    return rec.finish()


def report(data: dict) -> str:
    """A short table of the numbers and the targets (whatever of them there is)."""
    c = data["checks"]
    nan = float("nan")
    lines = []
    if "copy_GBps" in c.get("copy", {}):
        lines.append(f"copy 1 GiB: {c['copy']['copy_GBps']:.0f} GB/s copied ({c['copy']['read_plus_write_GBps']:.0f} "
                     "read + written)")
    for name, v in c.items():
        if name.startswith("normal_R") and "dispatch" in v:
            for op in ("dispatch", "combine"):
                k, call = v[op].get("kernel", {}), v[op].get("call", {})
                lines.append(f"{name} C={v.get('channels_ran')} {op}: kernel {k.get('median_us', nan):.0f} us "
                             f"({k.get('per_rank_GBps', nan):.0f} GB/s per rank, {k.get('aggregate_GBps', nan):.0f} "
                             f"all ranks, {k.get('of_copy', nan):.2f} of copy); call {call.get('median_us', nan):.0f} "
                             f"us ({call.get('of_copy', nan):.2f} of copy)")
        if name.startswith("ll_R") and "eager" in v:
            for op in ("dispatch", "combine"):
                e = v["eager"].get(op, {})
                g = v.get("graph", {}).get(op, {})
                lines.append(f"{name} {op}: {e.get('median_us', nan):.1f} us eager ({e.get('per_rank_GBps', nan):.0f} "
                             f"GB/s per rank), {g.get('median_us', nan):.1f} us graph replay")
    for k, t in data.get("targets", {}).items():
        verdict = "met" if t["met"] else "NOT met" if t["met"] is False else "no number"
        lines.append(f"target {k}: {t['value']} (target {t['target']}): {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
