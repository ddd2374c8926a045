"""An expert-parallel MoE layer (``moe_comm.EPMoE``) on CPU ranks, in every mode, checked against a dense one.

Every rank builds the same seeded MoE layer (softmax top-k router, SwiGLU experts split evenly over the
ranks) and its own tokens, then runs the layer the ways a serving engine does:

* prefill with BF16 experts: ``sequential`` (normal-mode dispatch, grouped-GEMM experts, combine) and
  ``chunked`` (the same over micro-batches, the next dispatch and the last combine in flight while the
  experts run);
* decode on the first ``--decode-tokens`` tokens with FP8 experts (128x128 block scales, FP8 dispatch):
  ``low_latency`` and ``two_batch`` (two micro-batches overlapped through receive hooks).

Each rank also computes what every mode must return with all experts in one process
(``moe_comm.moe.ep_moe_reference``); the demo exits 1 unless every mode matches it bit for bit and is
within the accuracy standard of the fp64 specification. Rank 0 prints a table of layer times (median
over iterations of the max over ranks).

    python examples/demo.py [--ranks 4]              # local ranks (moe_comm.launch.LocalWorld)
    torchrun --nproc-per-node 4 examples/demo.py     # or: mpirun -n 4 python examples/demo.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

import moe_comm
from moe_comm import accuracy
from moe_comm.launch import LocalWorld, init_from_env, launcher_rank
from moe_comm.moe import Experts, ep_moe_reference, select_experts

#: (mode, phase, FP8 experts)
RUNS = (("sequential", "prefill", False), ("chunked", "prefill", False), ("low_latency", "decode", True),
        ("two_batch", "decode", True))


def make_model(cfg: dict[str, Any]) -> tuple[torch.Tensor, Experts, Experts]:
    """The full layer, identical on every rank: fp32 router [H, E] and the experts in BF16 and in FP8."""
    H, FF, E = cfg["hidden"], cfg["ffn"], cfg["experts"]
    g = torch.Generator().manual_seed(cfg["seed"])
    router = torch.randn(H, E, generator=g) * H ** -0.5
    w13 = torch.randn(E, 2 * FF, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, FF, generator=g) * (2.0 / FF ** 0.5)  # output RMS of order 1
    return router, Experts(w13.bfloat16(), w2.bfloat16()), Experts.quantized(w13, w2)


def _timed(fn, group: dist.ProcessGroup, warmup: int, iters: int) -> float:
    """Median over iterations of the max over ranks of fn()'s seconds."""
    for _ in range(warmup):
        fn()
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return statistics.median(times.tolist())


def run_rank(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Every mode's forward, checks and timing on one rank (collective over ``group``); results on rank 0."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T, H, E, K, M = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"], cfg["decode_tokens"]
    router, bf16, fp8 = make_model(cfg)
    xs = [torch.randn(T, H, generator=torch.Generator().manual_seed(cfg["seed"] + 1 + r)).bfloat16() for r in range(R)]
    routes = [select_experts(x.float() @ router, K, renormalize=True) for x in xs]
    local = E // R
    buf = moe_comm.Buffer(group, num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                          low_latency_mode=True, backend=cfg["backend"])
    res: dict[str, Any] = {"ranks": R, "backend": buf.backend_choice.name, "transport": buf.transport_name, "runs": []}
    for mode, phase, use_fp8 in RUNS:
        experts = fp8 if use_fp8 else bf16
        tokens = M if phase == "decode" else T
        layer = moe_comm.EPMoE(buf, experts.select(rank * local, local), E, top_k=K, renormalize=True, mode=mode,
                               num_chunks=cfg["chunks"], num_max_dispatch_tokens_per_rank=M)
        x = xs[rank][:tokens]
        logits = x.float() @ router
        out = layer(x, router_logits=logits)
        inputs = ([x_[:tokens] for x_ in xs], [i[:tokens] for i, _ in routes], [w[:tokens] for _, w in routes])
        exact = torch.equal(out.view(torch.int16), ep_moe_reference(*inputs, experts, mode, cfg["chunks"])[rank]
                            .view(torch.int16))
        spec = ep_moe_reference(*inputs, experts, mode, cfg["chunks"], fp64=True)[rank]
        report = accuracy.check(mode, out, spec, torch.bfloat16, raise_on_fail=False)
        verdict = torch.tensor([float(exact), float(report.passed), report.metrics.get("calc_diff", 0.0),
                                report.metrics.get("max_abs", 0.0)], dtype=torch.float64)
        worst = verdict.clone()
        dist.all_reduce(worst[:2], op=dist.ReduceOp.MIN, group=group)  # every rank must pass
        dist.all_reduce(worst[2:], op=dist.ReduceOp.MAX, group=group)
        seconds = _timed(lambda: layer(x, router_logits=logits), group, cfg["warmup"], cfg["iters"])
        res["runs"].append({"mode": mode, "phase": phase, "experts": "fp8 e4m3" if use_fp8 else "bf16",
                            "tokens": tokens, "bitwise": bool(worst[0]), "accuracy": bool(worst[1]),
                            "calc_diff": float(worst[2]), "max_abs": float(worst[3]), "seconds": seconds})
    res["passed"] = all(r["bitwise"] and r["accuracy"] for r in res["runs"])
    return res if rank == 0 else None


def report(res: dict[str, Any], cfg: dict[str, Any], launcher: str) -> None:
    """Prints the results table and the PASS/FAIL line (rank 0)."""
    R = res["ranks"]
    print(f"moe_comm demo: EP MoE layer (moe_comm.EPMoE) vs dense reference ({launcher}, backend "
          f"{res['backend']}, transport {res['transport']}, {R} ranks)")
    print(f"hidden {cfg['hidden']}, ffn {cfg['ffn']}, top-{cfg['topk']} of {cfg['experts']} experts, chunked mode: "
          f"{cfg['chunks']} chunks")
    header = ["phase", "mode", "experts", "tokens/rank", "layer ms", "tokens/s (all ranks)", "= reference",
              "calc_diff vs fp64", "max abs err"]
    rows = [[f"{r['phase']}", r["mode"], r["experts"], str(r["tokens"]), f"{r['seconds'] * 1e3:.2f}",
             f"{R * r['tokens'] / r['seconds']:.0f}", "bitwise" if r["bitwise"] else "NO",
             f"{r['calc_diff']:.2e}" + ("" if r["accuracy"] else " FAIL"), f"{r['max_abs']:.2e}"] for r in res["runs"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("-" * (sum(widths) + 2 * len(widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print(f"times: median over {cfg['iters']} iterations (after {cfg['warmup']} warm-up) of the max over ranks; "
          f"'= reference': each rank's output vs the same layer with all experts in one process; calc_diff and "
          f"max abs err: worst rank, against the fp64 specification (moe_comm.accuracy, bf16 limits)")
    worst = max(r["calc_diff"] for r in res["runs"])
    verdict = "PASS" if res["passed"] else "FAIL"
    print(f"{verdict}: {sum(r['bitwise'] for r in res['runs'])} of {len(res['runs'])} modes bitwise equal to the "
          f"reference, worst calc_diff {worst:.3e}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--backend", default="auto", help="Buffer(backend=...): auto, portable, cuda_host, ...")
    p.add_argument("--tokens", type=int, default=256, help="prefill tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=512, help="expert FFN width (a multiple of 128: FP8 experts)")
    p.add_argument("--experts", type=int, default=16, help="total experts, a multiple of the rank count")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--chunks", type=int, default=4, help="micro-batches of the chunked prefill")
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="tokens per rank of the decode step (its num_max_dispatch_tokens_per_rank)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    found = launcher_rank()
    ranks = found[1] if found else args.ranks
    if ranks < 1 or args.experts % ranks or not 1 <= args.topk <= args.experts or min(
            args.tokens, args.hidden, args.ffn, args.iters, args.decode_tokens, args.chunks) < 1 or args.warmup < 0 \
            or args.hidden % 128 or args.ffn % 128 or args.decode_tokens > args.tokens:
        raise SystemExit(f"demo: need --experts a multiple of the rank count ({ranks}), 1 <= --topk <= --experts, "
                         f"--hidden and --ffn multiples of 128, 1 <= --decode-tokens <= --tokens, positive sizes, "
                         f"--chunks and --iters; got {vars(args)}")
    cfg = {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts", "topk", "chunks", "decode_tokens",
                                         "warmup", "iters", "seed", "backend")}
    if found is None:
        with LocalWorld(ranks, timeout_s=600) as world:
            res = world.run(run_rank, cfg)[0]
        report(res, cfg, f"{ranks} local ranks")
        return 0 if res["passed"] else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("MPI_LOCALNRANKS", ranks)))
    threads = max(1, (os.cpu_count() or 1) // local)
    os.environ.setdefault("MOE_COMM_NUM_THREADS", str(threads))  # before any moe_comm kernel runs
    torch.set_num_threads(threads)
    group = init_from_env()
    try:
        res = run_rank(group, cfg)
        flag = torch.tensor([0.0 if res is None or res["passed"] else 1.0])
        dist.broadcast(flag, 0, group=group)  # every rank exits with rank 0's verdict
        if res is not None:
            report(res, cfg, f"{found[2]}, {ranks} ranks")
        dist.barrier(group)
    finally:
        dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
