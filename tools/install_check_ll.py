"""The check tools/install_check.sh runs in each venv it installs moe-comm into: what the build holds
(``moe_comm.build_info()``), then one low-latency dispatch + combine on 2 local CPU ranks per backend,
against a reference computed in each rank. Exits 1, saying what differed, on any mismatch.

    python tools/install_check_ll.py --built cuda_host,cuda --missing cuda_nvshmem [--backends portable,cuda_host]

``--built P``: ``build_info()[P]`` must be True (``cuda_nvshmem`` must also load, with NVSHMEM's host
library, without a GPU); ``--missing P``: it must be False and ``build_info()["P_not_built"]`` must say
why (``--reason-has TEXT`` checks that the reasons contain TEXT). Run it from outside the source tree,
so that ``import moe_comm`` is the installed package (it checks that too).
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

import moe_comm

TOKENS, HIDDEN, EXPERTS_PER_RANK, TOPK = 8, 256, 2, 2


def ll_round_trip(group: dist.ProcessGroup, backend: str) -> dict:
    """One low-latency dispatch and combine (BF16): the received counts, and the combined rows where every
    expert e multiplies what it received by 2 ** (e % 4) (exact in BF16), against x * sum_k w_k 2 ** (e_k % 4)."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    experts = EXPERTS_PER_RANK * ranks
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    topk_idx = torch.randn(TOKENS, experts, generator=gen).topk(TOPK, dim=-1).indices.to(torch.int64)
    topk_idx[0, 1] = -1  # a slot that goes nowhere
    topk_weights = torch.rand(TOKENS, TOPK, generator=gen) + 0.5
    buf = moe_comm.Buffer(group, low_latency_mode=True, backend=backend, num_qps_per_rank=EXPERTS_PER_RANK,
                          num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, ranks, experts),
                          explicitly_destroy=True, timeout_s=60)
    try:
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, TOKENS, experts, use_fp8=False)
        everyone = [torch.empty_like(topk_idx) for _ in range(ranks)]
        dist.all_gather(everyone, topk_idx, group=group)
        first = rank * EXPERTS_PER_RANK
        want_count = [sum(int((idx == first + i).sum()) for idx in everyone) for i in range(EXPERTS_PER_RANK)]
        got_count = [int(c) for c in recv_count]
        y = recv_x.clone()
        for i in range(EXPERTS_PER_RANK):
            y[i] *= 2.0 ** ((first + i) % 4)
        combined, _, _ = buf.low_latency_combine(y, topk_idx, topk_weights, handle)
    finally:
        buf.destroy()
    scale = torch.where(topk_idx >= 0, 2.0 ** (topk_idx % 4).float(), torch.zeros(()))
    want = x.float() * (topk_weights * scale).sum(dim=1, keepdim=True)
    err = (combined.float() - want).abs().max().item()
    ok = got_count == want_count and combined.shape == want.shape and bool(torch.allclose(combined.float(), want,
                                                                                          rtol=1e-2, atol=1e-2))
    return {"rank": rank, "backend": buf.backend_choice.name, "ok": ok, "counts": got_count,
            "want_counts": want_count, "max_abs_err": err}


def check_build(built: list[str], missing: list[str], reason_has: str) -> list[str]:
    """What differs from the expected build; prints build_info()."""
    problems = []
    info = moe_comm.build_info()
    print("build_info:", json.dumps(info, sort_keys=True, default=str))
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(moe_comm.__file__).resolve()
    if site not in where.parents:
        problems.append(f"moe_comm was imported from {where}, not from this environment's {site}")
    if info.get("cpu") is not True:
        problems.append(f"moe_comm._C is missing: {info.get('error')}")
    for part in built:
        if info.get(part) is not True:
            problems.append(f"{part}: expected built, build_info says {info.get(part)!r} "
                            f"({info.get(part + '_not_built') or info.get(part + '_error')})")
        elif info.get(f"{part}_not_built"):
            problems.append(f"{part}: built, yet build_info has a reason it was not: {info[part + '_not_built']!r}")
    if "cuda_nvshmem" in built and info.get("cuda_nvshmem"):
        from moe_comm.backends.cuda import nvshmem_lib
        problem = nvshmem_lib.available()
        if problem is not None:
            problems.append(f"cuda_nvshmem: built but does not load: {problem}")
    for part in missing:
        why = info.get(f"{part}_not_built")
        if info.get(part) is not False:
            problems.append(f"{part}: expected missing, build_info says {info.get(part)!r}")
        elif not why:
            problems.append(f"{part}: missing, and build_info has no {part}_not_built saying why")
        elif reason_has and reason_has not in why:
            problems.append(f"{part}: the reason {why!r} does not contain {reason_has!r}")
        else:
            print(f"{part} not built: {why}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--built", default="", help="comma-separated parts build_info() must report built")
    parser.add_argument("--missing", default="", help="comma-separated parts build_info() must report missing, with why")
    parser.add_argument("--reason-has", default="", help="text every --missing part's reason must contain")
    parser.add_argument("--backends", default="portable,cuda_host", help="the Buffer backends to run on 2 ranks")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    split = lambda s: [p for p in s.split(",") if p]  # noqa: E731
    problems = check_build(split(args.built), split(args.missing), args.reason_has)
    for backend in split(args.backends):
        t0 = time.perf_counter()
        try:
            results = moe_comm.spawn(ll_round_trip, args.ranks, backend, timeout_s=120)
        except Exception as exc:  # a rank's traceback, or a timeout: reported, then the next backend
            problems.append(f"{backend}: {args.ranks}-rank low-latency dispatch/combine failed: {exc}")
            continue
        print(f"{backend}: {args.ranks} ranks, low-latency dispatch/combine in {time.perf_counter() - t0:.1f} s:",
              json.dumps(results))
        problems += [f"{backend}: rank {r['rank']} differs from the reference: {r}" for r in results if not r["ok"]]
        problems += [f"{backend}: rank {r['rank']} ran on backend {r['backend']!r}" for r in results
                     if r["backend"] != backend]
    for problem in problems:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
