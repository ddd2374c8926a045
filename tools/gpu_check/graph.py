"""CUDA-graph capture and replay of the low-latency launches (they never synchronise the host, so they
can be captured): for R emulated ranks, dispatch send + receive and combine send + receive are
captured into one graph on a side stream with ``torch.cuda.graph``; the graph is replayed ``--replays``
times, each time after new inputs (x, top-k ids, weights, combine rows) were copied into the tensors
it reads and its outputs were zeroed, and each replay's outputs must equal, byte for byte, an eager
run of the same launches on the same inputs. The first input set's eager run is also compared with
moe_comm._cuda_host (R CPU threads).

    python tools/gpu_check/graph.py --ranks 8 --replays 3 --json OUT.json
"""
from __future__ import annotations

import argparse
import sys

import common  # noqa: F401  (import path)
from harness import (EmulatedSide, HostSide, LowLatencyCase, LowLatencyShape, compare, ll_semantics,
                     low_latency_inputs)


def check_format(R: int, fmt: str, replays: int, timeout_s: float) -> dict:
    import torch
    s = LowLatencyShape(R=R, L=4, M=16, H=1024, T=16, K=4, fmt=fmt)
    sets = [low_latency_inputs(LowLatencyShape(**{**s.__dict__, "seed": s.seed + k})) for k in range(replays)]
    side = EmulatedSide(R, timeout_s)
    case = LowLatencyCase(side, s, sets[0])
    eager = []
    for k in range(replays):  # eager runs first: they also load every kernel before the capture
        case.load(sets[k])
        case.clear_outputs()
        eager.append(case.run())
    out: dict = {"shape": s.__dict__}
    host_bad = compare(LowLatencyCase(HostSide(R, timeout_s), s, sets[0]).run(), eager[0])
    out["eager_vs_host"] = host_bad[:10] or "equal"
    out["eager_semantics"] = ll_semantics(sets[0], eager[0], s)[:10] or "ok"
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        case.dispatch()  # send + receive, call 1 (half 0)
        case.combine()   # send + receive, call 2 (half 1)
    out["captured"] = True
    results = []
    for k in range(replays):
        case.load(sets[k])
        case.clear_outputs()
        graph.replay()
        torch.cuda.synchronize()
        records = case.obj.check()
        bad = compare(eager[k], case.outputs())
        if records != [None] * R:
            bad.append(f"error records after replay {k}: {records}")
        results.append(bad[:10] or "equal")
    out["replays"] = results
    out["inputs_differ_between_replays"] = not torch.equal(sets[0][0]["x"], sets[-1][0]["x"]) if replays > 1 else None
    out["ok"] = not host_bad and out["eager_semantics"] == "ok" and all(r == "equal" for r in results)
    side.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="emulated ranks (1-8)")
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "fp8_ue8m0"])
    ap.add_argument("--timeout", type=float, default=20.0, help="kernel wait deadline, seconds")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rec = common.Record(a.json, tool="graph", ranks=a.ranks, replays=a.replays)
    if not common.gpu_present():
        rec.check("gpu", lambda: {"ok": False, "error": "no CUDA device (torch.cuda.is_available() is False)"})
        return rec.finish()
    for fmt in a.formats:
        rec.check(f"R{a.ranks}_{fmt}", lambda fmt=fmt: check_format(a.ranks, fmt, a.replays, a.timeout))
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
