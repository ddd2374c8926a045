"""An expert-parallel MoE layer forward with moe_comm (DeepEP v1 ``Buffer`` API), checked against a dense one.

Every rank builds the same seeded MoE layer (softmax top-k router, SwiGLU experts; experts split evenly
over ranks) and its own tokens, then runs it both ways DeepEP serves it:

* prefill, normal mode: get_dispatch_layout -> dispatch (each token goes to the ranks owning its
  experts) -> local expert FFNs, each output row weighted by its received top-k weight (combine does
  not weight) -> combine (rows go back to their source rank and are summed);
* decode, low-latency mode on the first ``--decode-tokens`` tokens: low_latency_dispatch with the
  in-op FP8 cast and a recv hook -> local experts on the fixed [E_loc, R * M, H] blocks ->
  low_latency_combine (weights the expert outputs and sums them).

Each rank also computes the same MoE for its own tokens without communication; the demo exits 1 unless
both ways agree with it (DeepEP calc_diff <= 1e-4 for BF16, <= 9e-4 for FP8 decode; all finite).
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

MAX_CALC_DIFF = {"normal": 1e-4, "low_latency": 9e-4}  # BF16 prefill; FP8 decode (DeepEP's low-latency FP8 limit)
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


def low_latency_experts(recv_x: tuple[torch.Tensor, torch.Tensor], recv_count: torch.Tensor, w: Weights,
                        first: int) -> torch.Tensor:
    """This rank's experts on the valid rows of each fixed block (dequantized FP8), unweighted: the
    low-latency combine applies the top-k weights. bf16 [E_loc, R * M, H], zero past recv_count."""
    q, scales = recv_x
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    for e, n in enumerate(recv_count.tolist()):
        if n:
            rows = moe_comm.ops.per_token_cast_back(q[e, :n], scales[e, :n])
            out[e, :n] = swiglu(rows, w, first + e).bfloat16()
    return out


def _timed(fn_a, fn_b, group: dist.ProcessGroup, warmup: int, iters: int) -> list[float]:
    """Median over iterations of the max over ranks of the time of fn_a() and of fn_b(fn_a())."""
    for _ in range(warmup):
        fn_b(fn_a())
    times = torch.zeros(2, iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier(group)
        t0 = time.perf_counter()
        got = fn_a()
        times[0, i] = time.perf_counter() - t0
        dist.barrier(group)
        t0 = time.perf_counter()
        fn_b(got)
        times[1, i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # per iteration: the slowest rank
    return [statistics.median(times[0].tolist()), statistics.median(times[1].tolist())]


def _agreement(combined: torch.Tensor, reference: torch.Tensor, rows: int, group: dist.ProcessGroup
               ) -> dict[str, float]:
    """Global calc_diff, max abs error, non-finite count and reference RMS from per-rank sums."""
    a, b = combined.double() + 1, reference.double() + 1
    sums = torch.tensor([(a * b).sum(), (a * a + b * b).sum(), (~combined.isfinite()).sum(), rows,
                         reference.double().square().sum(), reference.numel()], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    max_err = torch.tensor([(combined.float() - reference.float()).abs().max().item() if combined.numel() else 0.0],
                           dtype=torch.float64)
    dist.all_reduce(max_err, op=dist.ReduceOp.MAX, group=group)
    return {"calc_diff": float(1 - 2 * sums[0] / sums[1]), "max_abs_err": float(max_err),
            "nonfinite": int(sums[2]), "rows": int(sums[3]), "ref_rms": float((sums[4] / sums[5]).sqrt())}


def run_rank(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Both forwards, checks and timing on one rank (collective over ``group``); results on rank 0, else None."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T, H, E, K, M = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["topk"], cfg["decode_tokens"]
    w = make_weights(cfg)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(cfg["seed"] + 1 + rank)).bfloat16()
    topk_idx, topk_weights = route(x, w["router"], K)
    reference = dense_reference(x, topk_idx, topk_weights, w)
    per_rank = E // R
    buf = moe_comm.Buffer(group, num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                          low_latency_mode=True)
    res: dict[str, Any] = {"ranks": R, "transport": buf.transport_name}

    # prefill: normal mode
    tokens_per_rank, _, tokens_per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    routing = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=tokens_per_rank,
                   is_token_in_rank=in_rank, num_tokens_per_expert=tokens_per_expert)
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(x, **routing)
    expert_out = local_experts(recv_x, recv_idx, recv_w, w, rank * per_rank, per_rank)
    combined, _, _ = buf.combine(expert_out, handle)
    normal = _agreement(combined, reference, recv_x.shape[0], group)
    normal["bytes"] = normal["rows"] * H * 2  # bf16 rows received, own rank included (DeepEP's rule)
    normal["dispatch_s"], normal["combine_s"] = _timed(lambda: buf.dispatch(x, **routing)[4],
                                                       lambda h: buf.combine(expert_out, h), group,
                                                       cfg["warmup"], cfg["iters"])
    res["normal"] = normal

    # decode: low-latency mode, FP8 dispatch with a recv hook
    xd, idx_d, w_d = x[:M], topk_idx[:M], topk_weights[:M]

    def ll_dispatch() -> tuple:
        recv, count, ll_handle, _, hook = buf.low_latency_dispatch(xd, idx_d, M, E, use_fp8=True,
                                                                   return_recv_hook=True)
        hook()  # a decode step would run attention for the next micro-batch before this
        return recv, count, ll_handle

    recv, count, ll_handle = ll_dispatch()
    ll_out = low_latency_experts(recv, count, w, rank * per_rank)
    combined_d, _, _ = buf.low_latency_combine(ll_out, idx_d, w_d, ll_handle)
    decode = _agreement(combined_d, reference[:M], int(count.sum()), group)
    decode["bytes"] = int(decode["rows"]) * (H + H // 128 * 4 + 16)  # DeepEP's LL FP8 dispatch message bytes
    decode["dispatch_s"], decode["combine_s"] = _timed(ll_dispatch, lambda r: buf.low_latency_combine(
        ll_out, idx_d, w_d, r[2]), group, cfg["warmup"], cfg["iters"])
    res["low_latency"] = decode
    res["passed"] = all(m["nonfinite"] == 0 and m["calc_diff"] == m["calc_diff"] and
                        m["calc_diff"] <= MAX_CALC_DIFF[name] for name, m in (("normal", normal),
                                                                               ("low_latency", decode)))
    return res if rank == 0 else None


def report(res: dict[str, Any], cfg: dict[str, Any], launcher: str) -> None:
    """Prints the results table and the PASS/FAIL line (rank 0)."""
    n, d = res["normal"], res["low_latency"]

    def both(fn) -> tuple[str, str]:
        return fn(n), fn(d)

    rows = [("ranks", (res["ranks"], res["ranks"]), ""),
            ("transport", (res["transport"],) * 2, ""),
            ("tokens (total)", (res["ranks"] * cfg["tokens"], res["ranks"] * cfg["decode_tokens"]), "tokens"),
            ("hidden / ffn", (f"{cfg['hidden']}/{cfg['ffn']}",) * 2, ""),
            ("experts / top-k", (f"{cfg['experts']}/{cfg['topk']}",) * 2, ""),
            ("dispatch payload", ("bf16", "fp8 e4m3"), ""),
            ("rows moved (each way)", both(lambda m: m["rows"]), "rows"),
            ("MB moved (dispatch)", both(lambda m: f"{m['bytes'] / 1e6:.2f}"), "MB"),
            ("dispatch", both(lambda m: f"{m['dispatch_s'] * 1e3:.2f}"), "ms"),
            ("combine", both(lambda m: f"{m['combine_s'] * 1e3:.2f}"), "ms"),
            ("dispatch bandwidth", both(lambda m: f"{m['bytes'] / m['dispatch_s'] / 1e9:.3f}"), "GB/s"),
            ("reference RMS", both(lambda m: f"{m['ref_rms']:.3f}"), ""),
            ("max abs err", both(lambda m: f"{m['max_abs_err']:.3e}"), ""),
            ("calc_diff", both(lambda m: f"{m['calc_diff']:.3e}"), ""),
            ("calc_diff limit", (f"{MAX_CALC_DIFF['normal']:g}", f"{MAX_CALC_DIFF['low_latency']:g}"), ""),
            ("non-finite outputs", both(lambda m: m["nonfinite"]), "")]
    w0 = max(len(r[0]) for r in rows)
    w1 = max([len("prefill (normal)")] + [len(str(r[1][0])) for r in rows])
    w2 = max([len("decode (low-latency)")] + [len(str(r[1][1])) for r in rows])
    print(f"moe_comm demo: EP MoE forward vs dense reference ({launcher})")
    print(f"{'quantity':<{w0}}  {'prefill (normal)':>{w1}}  {'decode (low-latency)':>{w2}}  unit")
    print("-" * (w0 + w1 + w2 + 10))
    for name, (a, b), unit in rows:
        print(f"{name:<{w0}}  {a!s:>{w1}}  {b!s:>{w2}}  {unit}")
    print(f"times: median over {cfg['iters']} iterations (after {cfg['warmup']} warm-up) of the max over ranks; "
          f"bytes: DeepEP's rules (normal: received bf16 rows x hidden x 2; low-latency: per (token, expert) "
          f"hidden + hidden/128*4 + 16); GB/s = bytes / median time")
    verdict = "PASS" if res["passed"] else "FAIL"
    print(f"{verdict}: calc_diff {n['calc_diff']:.3e} (prefill) and {d['calc_diff']:.3e} (decode), "
          f"{n['nonfinite'] + d['nonfinite']} non-finite output(s)")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="local ranks to spawn (ignored under torchrun/mpirun)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN width")
    p.add_argument("--experts", type=int, default=16, help="total experts, a multiple of the rank count")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="tokens per rank of the low-latency decode step (its num_max_dispatch_tokens_per_rank)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    found = launcher_rank()
    ranks = found[1] if found else args.ranks
    if ranks < 1 or args.experts % ranks or not 1 <= args.topk <= args.experts or min(
            args.tokens, args.hidden, args.ffn, args.iters, args.decode_tokens) < 1 or args.warmup < 0 \
            or args.hidden % 128 or args.decode_tokens > args.tokens:
        raise SystemExit(f"demo: need --experts a multiple of the rank count ({ranks}), 1 <= --topk <= --experts, "
                         f"--hidden a multiple of 128, 1 <= --decode-tokens <= --tokens, positive sizes and --iters; "
                         f"got {vars(args)}")
    cfg = {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts", "topk", "decode_tokens", "warmup",
                                         "iters", "seed")}
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
