"""An expert-parallel MoE layer forward with moe_comm (DeepEP v1 ``Buffer`` API), checked against a dense one.

Every rank builds the same seeded MoE layer (softmax top-k router, SwiGLU experts; experts split evenly
over ranks) and its own tokens, then runs DeepEP's normal-mode forward:
get_dispatch_layout -> dispatch (each token goes to the ranks owning its experts) -> local expert FFNs,
each output row weighted by its received top-k weight (combine does not weight) -> combine (rows go
back to their source rank and are summed). Each rank also computes the same MoE for its own tokens
without communication; the demo exits 1 unless the two agree (DeepEP calc_diff <= 1e-4, all finite).
Rank 0 prints sizes, bytes moved, dispatch/combine times (median over iterations of the max over ranks).

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
import torch.nn.functional as F

import moe_comm
from moe_comm.launch import LocalWorld, init_from_env, launcher_rank

MAX_CALC_DIFF = 1e-4
Weights = dict[str, torch.Tensor]


def make_weights(cfg: dict[str, Any]) -> Weights:
    """The full layer, identical on every rank: fp32 router [H, E], w1/w3 [E, H, F], w2 [E, F, H]."""
    H, FF, E = cfg["hidden"], cfg["ffn"], cfg["experts"]
    g = torch.Generator().manual_seed(cfg["seed"])
    return {"router": torch.randn(H, E, generator=g) * H ** -0.5,
            "w1": torch.randn(E, H, FF, generator=g) * H ** -0.5,
            "w3": torch.randn(E, H, FF, generator=g) * H ** -0.5,
            "w2": torch.randn(E, FF, H, generator=g) * (2.0 / FF ** 0.5)}  # output RMS of order 1


def route(x: torch.Tensor, router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, weights renormalised to sum 1: (topk_idx [T, K] int64, topk_weights fp32)."""
    probs = torch.softmax(x.float() @ router, dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx.to(moe_comm.topk_idx_t), weights / weights.sum(-1, keepdim=True)


def swiglu(x: torch.Tensor, w: Weights, e: int) -> torch.Tensor:
    """Expert ``e`` on bf16 rows: fp32 matmuls, bf16 hidden activation; returns fp32 [N, H]."""
    xf = x.float()
    h = (F.silu(xf @ w["w1"][e]) * (xf @ w["w3"][e])).bfloat16()
    return h.float() @ w["w2"][e]


def local_experts(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, w: Weights,
                  first: int, count: int) -> torch.Tensor:
    """This rank's experts on the received rows, weighted per slot and summed per row; bf16 [N, H]."""
    out = torch.zeros(recv_x.shape[0], recv_x.shape[1])
    for j in range(count):  # recv_topk_idx holds local expert ids (-1: another rank's expert)
        rows, slots = (recv_idx == j).nonzero(as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, recv_w[rows, slots, None] * swiglu(recv_x[rows], w, first + j))
    return out.bfloat16()


def dense_reference(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w: Weights) -> torch.Tensor:
    """The same MoE without communication: for each top-k slot, each chosen expert; bf16 [T, H]."""
    out = torch.zeros(x.shape[0], x.shape[1])
    for k in range(idx.shape[1]):
        for e in idx[:, k].unique().tolist():
            rows = (idx[:, k] == e).nonzero(as_tuple=True)[0]
            out.index_add_(0, rows, weights[rows, k, None] * swiglu(x[rows], w, e))
    return out.bfloat16()


def run_rank(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Forward, check and timing on one rank (collective over ``group``); results on rank 0, else None."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T, H, E, K = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"]
    w = make_weights(cfg)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(cfg["seed"] + 1 + rank)).bfloat16()
    topk_idx, topk_weights = route(x, w["router"], K)
    per_rank = E // R

    buf = moe_comm.Buffer(group)
    tokens_per_rank, _, tokens_per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    routing = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=tokens_per_rank,
                   is_token_in_rank=in_rank, num_tokens_per_expert=tokens_per_expert)

    def dispatch() -> tuple:
        return buf.dispatch(x, **routing)

    recv_x, recv_idx, recv_w, _, handle, _ = dispatch()
    expert_out = local_experts(recv_x, recv_idx, recv_w, w, rank * per_rank, per_rank)
    combined, _, _ = buf.combine(expert_out, handle)
    reference = dense_reference(x, topk_idx, topk_weights, w)

    # global calc_diff from per-rank sums; max abs error; non-finite count; rows received
    a, b = combined.double() + 1, reference.double() + 1
    sums = torch.tensor([(a * b).sum(), (a * a + b * b).sum(), (~combined.isfinite()).sum(), recv_x.shape[0],
                         reference.double().square().sum()], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    max_err = torch.tensor([(combined.float() - reference.float()).abs().max().item()], dtype=torch.float64)
    dist.all_reduce(max_err, op=dist.ReduceOp.MAX, group=group)

    for _ in range(cfg["warmup"]):
        buf.combine(expert_out, dispatch()[4])
    times = torch.zeros(2, cfg["iters"], dtype=torch.float64)
    for i in range(cfg["iters"]):
        dist.barrier(group)
        t0 = time.perf_counter()
        h = dispatch()[4]
        times[0, i] = time.perf_counter() - t0
        dist.barrier(group)
        t0 = time.perf_counter()
        buf.combine(expert_out, h)
        times[1, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # per iteration: the slowest rank

    calc_diff = float(1 - 2 * sums[0] / sums[1])
    nonfinite, rows = int(sums[2]), int(sums[3])
    res = {"calc_diff": calc_diff, "max_abs_err": float(max_err), "nonfinite": nonfinite, "rows": rows,
           "ref_rms": float((sums[4] / (R * T * H)).sqrt()), "ranks": R,
           "dispatch_s": statistics.median(times[0].tolist()), "combine_s": statistics.median(times[1].tolist())}
    res["passed"] = nonfinite == 0 and calc_diff == calc_diff and calc_diff <= MAX_CALC_DIFF
    return res if rank == 0 else None


def report(res: dict[str, Any], cfg: dict[str, Any], launcher: str) -> None:
    """Prints the results table and the PASS/FAIL line (rank 0)."""
    nbytes = res["rows"] * cfg["hidden"] * 2  # bf16 rows received, own rank included (DeepEP's rule)
    rows = [("ranks", res["ranks"], ""), ("tokens (total)", res["ranks"] * cfg["tokens"], "tokens"),
            ("hidden", cfg["hidden"], ""), ("ffn", cfg["ffn"], ""), ("experts", cfg["experts"], ""),
            ("top-k", cfg["topk"], ""), ("rows moved (each way)", res["rows"], "rows"),
            ("MB moved (each way)", f"{nbytes / 1e6:.2f}", "MB"),
            ("dispatch", f"{res['dispatch_s'] * 1e3:.2f}", "ms"), ("combine", f"{res['combine_s'] * 1e3:.2f}", "ms"),
            ("dispatch bandwidth", f"{nbytes / res['dispatch_s'] / 1e9:.3f}", "GB/s"),
            ("combine bandwidth", f"{nbytes / res['combine_s'] / 1e9:.3f}", "GB/s"),
            ("reference RMS", f"{res['ref_rms']:.3f}", ""),
            ("max abs err", f"{res['max_abs_err']:.3e}", ""), ("calc_diff", f"{res['calc_diff']:.3e}", ""),
            ("non-finite outputs", res["nonfinite"], "")]
    w0, w1 = max(len(r[0]) for r in rows), max(len(str(r[1])) for r in rows)
    print(f"moe_comm demo: EP MoE forward vs dense reference ({launcher})")
    print(f"{'quantity':<{w0}}  {'value':>{w1}}  unit\n{'-' * (w0 + w1 + 8)}")
    for name, value, unit in rows:
        print(f"{name:<{w0}}  {value!s:>{w1}}  {unit}")
    print(f"times: median over {cfg['iters']} iterations (after {cfg['warmup']} warm-up) of the max over ranks; "
          f"bytes: all ranks' received bf16 rows x hidden x 2; GB/s = bytes / median time")
    verdict = "PASS" if res["passed"] else "FAIL"
    print(f"{verdict}: calc_diff {res['calc_diff']:.3e} (limit {MAX_CALC_DIFF:g}), "
          f"{res['nonfinite']} non-finite output(s)")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN width")
    p.add_argument("--experts", type=int, default=16, help="total experts, a multiple of the rank count")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    found = launcher_rank()
    ranks = found[1] if found else args.ranks
    if ranks < 1 or args.experts % ranks or not 1 <= args.topk <= args.experts or min(
            args.tokens, args.hidden, args.ffn, args.iters) < 1 or args.warmup < 0:
        raise SystemExit(f"demo: need --experts a multiple of the rank count ({ranks}), 1 <= --topk <= --experts, "
                         f"positive sizes and --iters; got {vars(args)}")
    cfg = {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts", "topk", "warmup", "iters", "seed")}
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
