"""Emulated ranks of moe_comm._cuda (R ranks in each launch on one GPU) against moe_comm._cuda_host (R
threads on the CPU), on the same inputs, byte for byte: normal mode (notify, dispatch, prologue,
combine) in bf16 and FP8, the same across 2 emulated nodes of R / 2 ranks (the internode kernels: RDMA
rings over DirectLink, forwarders, node rings), low latency (dispatch send/receive, combine
send/receive) in bf16, FP8 and FP8 with UE8M0 scales. The entry point compute-sanitizer runs (``--ranks 2 --small``).

    python tools/gpu_check/emulated.py --ranks 2 --small --json OUT.json
    python tools/gpu_check/emulated.py --ranks 2 --host-only      # the CPU reference alone (no GPU)
"""
from __future__ import annotations

import argparse
import sys

import common  # noqa: F401  (import path)
from harness import (EmulatedSide, HostSide, InternodeCase, InternodeShape, LowLatencyCase, LowLatencyShape,
                     NormalCase, NormalShape, compare, internode_inputs, ll_semantics, low_latency_inputs,
                     normal_inputs, sanity)

CASES = ("normal_bf16", "normal_fp8", "internode_bf16", "internode_fp8", "ll_bf16", "ll_fp8", "ll_fp8_ue8m0",
         "ll_bf16_logfmt")


def shapes(case: str, R: int, small: bool):
    if case.startswith("internode"):
        s = InternodeShape(R=R, C=2, L=2, H=256, T=12, K=2, chunk=2, combine_chunk=2, slots=8, rdma_slots=4,
                           rdma_chunk=2) if small else InternodeShape(R=R)
        return InternodeShape(**{**s.__dict__, "fp8": case.endswith("fp8"), "node_ranks": max(R // 2, 1)})
    if case.startswith("normal"):
        s = NormalShape(R=R, C=2, L=2, H=256, T=12, K=2, chunk=2, combine_chunk=2, slots=8) if small else \
            NormalShape(R=R)
        return NormalShape(**{**s.__dict__, "fp8": case.endswith("fp8")})
    fmt, logfmt = case[len("ll_"):].removesuffix("_logfmt"), case.endswith("_logfmt")
    s = LowLatencyShape(R=R, L=2, M=4, H=512, T=3, K=2) if small else LowLatencyShape(R=R)
    return LowLatencyShape(**{**s.__dict__, "fmt": fmt, "logfmt": logfmt})


def run_case(case: str, R: int, small: bool, host_only: bool, timeout_s: float) -> dict:
    s = shapes(case, R, small)
    normal = not case.startswith("ll")
    ins = internode_inputs(s) if case.startswith("internode") else normal_inputs(s) if normal else \
        low_latency_inputs(s)
    Case = InternodeCase if case.startswith("internode") else NormalCase if normal else LowLatencyCase
    host = HostSide(R, timeout_s)
    ref = Case(host, s, ins).run()
    out = {"shape": s.__dict__}
    bad = sanity(ins, ref, s) if normal else ll_semantics(ins, ref, s)
    if bad:
        return {**out, "ok": False, "reference_insane": bad}
    if host_only:
        return {**out, "ok": True, "compared": "host reference only"}
    side = EmulatedSide(R, timeout_s)
    got = Case(side, s, ins).run()
    side.close()
    bad = compare(ref, got)
    return {**out, "ok": not bad, "mismatches": bad[:20], "compared": "emulated _cuda vs _cuda_host, bitwise"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="emulated ranks per launch (1-8); several: each")
    ap.add_argument("--small", action="store_true", help="tiny shapes (for compute-sanitizer)")
    ap.add_argument("--host-only", action="store_true", help="only the _cuda_host reference (no GPU needed)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--timeout", type=float, default=30.0, help="kernel wait deadline, seconds")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rec = common.Record(a.json, tool="emulated", ranks=a.ranks, small=a.small, host_only=a.host_only)
    if not a.host_only and not common.gpu_present():
        rec.check("gpu", lambda: {"ok": False, "error": "no CUDA device (torch.cuda.is_available() is False)"})
        return rec.finish()
    for R in a.ranks:
        for case in a.cases:
            rec.check(f"R{R}_{case}", lambda case=case, R=R: run_case(case, R, a.small, a.host_only, a.timeout))
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
