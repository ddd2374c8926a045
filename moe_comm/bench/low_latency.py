"""Low-latency benchmark: DeepEP-style decode dispatch/combine on every transport, BF16 vs FP8, with and
without hooks, overlap with compute, the raw all-to-all and the memory-copy floor.

    python -m moe_comm.bench low_latency --ranks 4               # 4 local ranks (moe_comm.launch.LocalWorld)
    torchrun --nproc-per-node 4 -m moe_comm.bench low_latency    # launcher detected from the environment
    mpirun -n 4 python -m moe_comm.bench low_latency             # adds the mpi transport and MPI_Alltoallv
    python -m moe_comm.bench low_latency --tokens 32 64 128 --plot ll.png

Every case runs in the same launch on the same inputs; rank 0 prints a table per token count and
writes one JSON record. Time of one iteration = max over ranks of (perf_counter around the op,
after a barrier).
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.core.native import cpu_threads
from moe_comm.ops import per_token_cast_back

from .checks import calc_diff, require_all_ranks
from .floors import floor_columns, memcpy_bandwidth, mpi_all_to_all, vs_transport
from .options import add_output_args, add_rank_args, add_tokens_arg, command_line
from .plot import Panel, case_series, floor_series
from .python_calls import counted
from .ranks import launch_token_counts
from .record import publish
from .stats import case_rows, gather_results, time_cases
from .table import format_table
from .transports import runs_on

__all__ = ["run_rank", "panels", "main"]

BYTE_RULE = ("DeepEP test_low_latency, per (token, selected expert != -1) on the sending rank: FP8 dispatch "
             "H + H/128*4 + 16 bytes; BF16 combine 2H bytes. BF16 dispatch (DeepEP benchmarks FP8 only) counts "
             "2H like the combine. Hooked cases count the bytes of the whole operation against send + recv time. "
             "a2a_ceiling_fp8 (gloo all_to_all_single) and a2a_ceiling_fp8_mpi (MPI_Alltoallv) move exactly the FP8 "
             "dispatch bytes.")
BANDWIDTH_RULE = "GB/s per rank = (mean over ranks of that rank's bytes) / median iteration time / 1e9"
#: The ops with a memory-copy floor (their bytes are what a rank receives); the plot's panels.
FLOOR_OPS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16")


def run_rank(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Checks, then times, every case on this rank; returns the results on rank 0, else None.

    Collective over ``group``; module-level so ``LocalWorld`` can pickle it by name."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T, H, K, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    torch.manual_seed(cfg["seed"] + rank)
    x = (torch.randn(T, H) * 0.1).bfloat16()
    topk_idx = (torch.randn(T, E).abs() + 1).topk(K, dim=1).indices  # DeepEP's routing
    topk_weights = torch.randn(T, K).abs()
    size = moe_comm.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    bufs = {name: moe_comm.Buffer(group, num_rdma_bytes=size, low_latency_mode=True, num_qps_per_rank=E // R,
                                  **runs_on(name)) for name in cfg["transports"]}

    # --- correctness, once per transport, before anything is timed; transports must agree bitwise
    want = x.float() * topk_weights.sum(1, keepdim=True)
    checks: dict[str, float] = {}
    ok, outputs = True, {}
    for name, buf in bufs.items():
        recv_bf16, _, handle_bf16, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        (q, scales), _, handle_fp8, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
        deq = per_token_cast_back(q.view(-1, H), scales.contiguous().view(-1, H // 128)).view(q.shape)
        combined, _, _ = buf.low_latency_combine(recv_bf16, topk_idx, topk_weights, handle_bf16)
        checks[f"{name}_combine_bf16_calc_diff"] = calc_diff(combined, want)
        combined_fp8, _, _ = buf.low_latency_combine(deq, topk_idx, topk_weights, handle_fp8)
        checks[f"{name}_combine_fp8_calc_diff"] = calc_diff(combined_fp8, want)
        ok &= checks[f"{name}_combine_bf16_calc_diff"] < 1e-5 and checks[f"{name}_combine_fp8_calc_diff"] < 9e-4
        outputs[name] = (recv_bf16, q.view(torch.uint8), combined, combined_fp8, handle_bf16)
    first = outputs[cfg["transports"][0]]
    same = all(torch.equal(a, b) for other in outputs.values() for a, b in zip(first[:4], other[:4]))
    checks["transports_bitwise_equal"] = float(same)
    ok &= same
    require_all_ranks(ok, "low_latency", rank, checks, group)
    recv_bf16, handle_bf16 = first[0], first[4]
    python_calls = {name: _python_calls(buf, group, x, topk_idx, topk_weights, T, E, recv_bf16, handle_bf16)
                    for name, buf in bufs.items()}

    # raw all-to-all of exactly the FP8 message bytes, preallocated (the transport's ceiling)
    fp8_msg = H + H // 128 * 4 + 16
    experts_per_rank = E // R
    send_counts = torch.bincount(topk_idx.view(-1) // experts_per_rank, minlength=R)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    a2a_in = torch.zeros(sum(sc), fp8_msg, dtype=torch.uint8)
    a2a_out = torch.empty(sum(rc), fp8_msg, dtype=torch.uint8)

    a, b = torch.randn(cfg["compute"], cfg["compute"]), torch.randn(cfg["compute"], cfg["compute"])
    hooks: dict[str, Callable[[], None]] = {}

    def send(name: str, fn: Callable[[], tuple]) -> None:
        hooks[name] = fn()[-1]

    cases: dict[str, Callable[[], Any]] = {}
    for name, buf in bufs.items():
        dispatch = functools.partial(buf.low_latency_dispatch, x, topk_idx, T, E)
        combine = functools.partial(buf.low_latency_combine, recv_bf16, topk_idx, topk_weights, handle_bf16)
        cases.update({
            f"{name}_dispatch_bf16": functools.partial(dispatch, use_fp8=False),
            f"{name}_dispatch_fp8": dispatch,
            f"{name}_dispatch_fp8_hook_send": functools.partial(send, f"{name}_dispatch",
                                                                functools.partial(dispatch, return_recv_hook=True)),
            f"{name}_dispatch_fp8_hook_recv": functools.partial(lambda key: hooks.pop(key)(), f"{name}_dispatch"),
            f"{name}_combine_bf16": combine,
            f"{name}_combine_bf16_hook_send": functools.partial(send, f"{name}_combine",
                                                                functools.partial(combine, return_recv_hook=True)),
            f"{name}_combine_bf16_hook_recv": functools.partial(lambda key: hooks.pop(key)(), f"{name}_combine"),
            f"{name}_dispatch_fp8_then_compute": functools.partial(lambda d: (d(), a @ b), dispatch),
            f"{name}_dispatch_fp8_hook_overlap": functools.partial(
                lambda d: _overlapped(d(return_recv_hook=True), a, b), dispatch),
        })
    cases.update({"compute_only": lambda: a @ b,
                  "a2a_ceiling_fp8": lambda: dist.all_to_all_single(a2a_out, a2a_in, rc, sc, group=group)})
    if "mpi" in bufs:
        cases["a2a_ceiling_fp8_mpi"] = mpi_all_to_all(a2a_out, a2a_in, rc, sc)
    times = time_cases(cases, group, cfg["warmup"], cfg["iters"],
                       after_previous=frozenset(n for n in cases if n.endswith("_hook_recv")))

    selections = int((topk_idx >= 0).sum())
    fp8_bytes, bf16_bytes = selections * fp8_msg, selections * 2 * H
    per_op = {"dispatch_bf16": bf16_bytes, "dispatch_fp8": fp8_bytes, "dispatch_fp8_hook_send": fp8_bytes,
              "dispatch_fp8_hook_recv": fp8_bytes, "combine_bf16": bf16_bytes, "combine_bf16_hook_send": bf16_bytes,
              "combine_bf16_hook_recv": bf16_bytes, "dispatch_fp8_then_compute": fp8_bytes,
              "dispatch_fp8_hook_overlap": fp8_bytes}
    mine_bytes = {f"{name}_{op}": n for name in bufs for op, n in per_op.items()}
    mine_bytes.update({"compute_only": 0, "a2a_ceiling_fp8": fp8_bytes, "a2a_ceiling_fp8_mpi": fp8_bytes})
    bandwidth = memcpy_bandwidth(group, max(bf16_bytes, 1 << 20))
    res = gather_results(times, mine_bytes, checks, group)
    if res is None:
        return None
    return {**res, "python_calls_rank0": python_calls, "selections_rank0": selections,
            "threads_per_rank": torch.get_num_threads(),
            "kernel_threads_per_rank": cpu_threads(), "memcpy_GBps": bandwidth}


def _python_calls(buf: moe_comm.Buffer, group: dist.ProcessGroup, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, T: int, E: int, recv: torch.Tensor, handle: tuple) -> dict[str, int]:
    """Python calls of each op half of a hooked FP8 dispatch and BF16 combine on this rank's thread (a
    transport's own threads not counted), each half after a barrier: the second call of each, as every call
    of a decode loop after the first (which prepares its signature) makes them."""
    calls = {}
    # partials, not lambdas: a lambda would be one more Python call in the count
    for op, call in (("dispatch", functools.partial(buf.low_latency_dispatch, x, topk_idx, T, E,
                                                    return_recv_hook=True)),
                     ("combine", functools.partial(buf.low_latency_combine, recv, topk_idx, topk_weights, handle,
                                                   return_recv_hook=True))):
        for _ in range(2):
            dist.barrier(group)
            result, calls[f"{op}_send"] = counted(call)
            dist.barrier(group)
            _, calls[f"{op}_recv"] = counted(result[-1])
    return calls


def _overlapped(result: tuple, a: torch.Tensor, b: torch.Tensor) -> None:
    """Compute between the send and the receive of a hooked dispatch."""
    a @ b
    result[-1]()


def _rows(res: dict[str, Any], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's table rows: send+recv of the hooked ops, GB/s, against the ceiling, collective and the floor."""
    rows = case_rows(res)
    by = {r["case"]: r for r in rows}
    for name in cfg["transports"]:
        for op in ("dispatch_fp8", "combine_bf16"):  # a hooked op costs its send plus its recv
            total = by[f"{name}_{op}_hook_send"]["median_us"] + by[f"{name}_{op}_hook_recv"]["median_us"]
            by[f"{name}_{op}_hook_send"]["send_plus_recv_us"] = total
    for r in rows:
        seconds = r.get("send_plus_recv_us", r["median_us"]) * 1e-6
        r["GBps_per_rank"] = r["bytes_per_rank_mean"] / seconds / 1e9 if r["bytes_per_rank_mean"] and \
            not r["case"].endswith("_recv") and "compute" not in r["case"] else None
    ceiling = by["a2a_ceiling_fp8"]["GBps_per_rank"]
    for r in rows:
        r["vs_ceiling"] = r["GBps_per_rank"] / ceiling if r["GBps_per_rank"] else None
    vs_transport(rows)
    floor_columns(rows, res["memcpy_GBps"], FLOOR_OPS)
    return rows


def _notes(res: dict[str, Any], cfg: dict[str, Any], by: dict[str, dict[str, Any]]) -> list[str]:
    """What one run's columns mean, with the overlap, the floor's measured bandwidth and the threads."""
    overlap = [f"{name}: dispatch_fp8_then_compute {by[f'{name}_dispatch_fp8_then_compute']['median_us']:.0f} us vs "
               f"dispatch_fp8_hook_overlap {by[f'{name}_dispatch_fp8_hook_overlap']['median_us']:.0f} us"
               for name in cfg["transports"]]
    return [
        f"overlap (compute_only {by['compute_only']['median_us']:.0f} us): " + "; ".join(overlap),
        "case names are <transport>_<op>; vs_collective = collective median / this row's median for the same op",
        f"memory-copy floor: the bytes of the op / single-thread memcpy bandwidth (the faster of libc memcpy and torch copy_) measured in this run with "
        f"every rank copying at once ({res['memcpy_GBps']['concurrent']:.2f} GB/s per rank; alone: "
        f"{res['memcpy_GBps']['alone']:.2f} GB/s)",
        "hooked send/recv halves are timed separately, each after a barrier, so the recv half finds the payload "
        "already arrived (as DeepEP's per-kernel send/recv timings)",
        "low-latency outputs are fixed [E_loc, R*M, H]; rows past recv_count are zero pages never written",
        "Python calls per op half, rank 0's thread, a call after the first of its signature: " + "; ".join(
            f"{name}: dispatch send {c['dispatch_send']} / recv {c['dispatch_recv']}, combine send "
            f"{c['combine_send']} / recv {c['combine_recv']}" for name, c in res["python_calls_rank0"].items()) +
        (" (the cuda backend's eager path is cuda_host's Python: backends/cuda/prepared.py)"
         if "cuda_host" in res["python_calls_rank0"] else ""),
        f"{cfg['ranks']} ranks share {os.cpu_count()} CPU cores ({res['threads_per_rank']} torch / "
        f"{res['kernel_threads_per_rank']} moe_comm._C thread(s) per rank); shared, noisy VM",
    ]


COLUMNS = [("case", "case"), ("median_us", "median_us"), ("p10_p90", "p10/p90_us"),
           ("send_plus_recv_us", "send+recv_us"), ("GBps_per_rank", "GB/s/rank"),
           ("vs_collective", "vs_collective(x)"), ("floor_us", "memcpy_floor_us"), ("of_floor", "floor/median"),
           ("vs_ceiling", "vs_a2a_ceiling")]


def report(results: list[dict[str, Any]], command: str, launcher: str, *, cfgs: Sequence[dict[str, Any]],
           json_path: str, plot_path: Optional[str]) -> None:
    """Prints a table per run (token count) and writes the JSON record, and the plot if asked (rank 0 only)."""
    runs = []
    for res, cfg in zip(results, cfgs):
        rows = _rows(res, cfg)
        notes = _notes(res, cfg, {r["case"]: r for r in rows})
        print(f"== low_latency: ranks {cfg['ranks']}, tokens/rank (M) {cfg['tokens']}, hidden {cfg['hidden']}, "
              f"topk {cfg['topk']}, experts {cfg['experts']}, compute {cfg['compute']}^3 fp32 matmul")
        print(format_table(COLUMNS, rows))
        for r in rows:
            r.pop("p10_p90")
        print("\n".join(notes))
        print(f"bytes: {BYTE_RULE}\n{BANDWIDTH_RULE}\nchecks (max over ranks): "
              f"{ {k: f'{v:.2e}' for k, v in res['checks_max_over_ranks'].items()} }\n")
        runs.append({"tokens": cfg["tokens"], "selections_rank0": res["selections_rank0"],
                     "threads_per_rank": res["threads_per_rank"],
                     "kernel_threads_per_rank": res["kernel_threads_per_rank"], "notes": notes,
                     "memcpy_GBps": res["memcpy_GBps"], "checks_max_over_ranks": res["checks_max_over_ranks"],
                     "cases": rows})
    record = {"bench": "low_latency", "command": command, "launcher": launcher,
              "config": {**cfgs[0], "tokens": [c["tokens"] for c in cfgs]}, "byte_rule": BYTE_RULE,
              "bandwidth_rule": BANDWIDTH_RULE,
              "timing": "per iteration: dist.barrier, then perf_counter around the op; max over ranks", "runs": runs}
    title = (f"low latency: {cfgs[0]['ranks']} ranks, hidden {cfgs[0]['hidden']}, top-{cfgs[0]['topk']} of "
             f"{cfgs[0]['experts']} experts")
    publish(record, json_path, plot_path, title, panels)


def panels(record: dict[str, Any]) -> list[Panel]:
    """The plot of a JSON record: one panel per op with a floor, a line per transport, the hooked
    variant's send + recv (FP8 dispatch, combine), the raw all-to-alls beside FP8 dispatch (the same
    bytes), and the memory-copy floor."""
    runs = [(run["tokens"], {r["case"]: r for r in run["cases"]}) for run in record["runs"]]
    transports = record["config"]["transports"]
    out = []
    for op in FLOOR_OPS:
        series = [case_series(runs, f"{t}_{op}", t, "ours") for t in transports]
        if op != "dispatch_bf16":
            series += [case_series(runs, f"{t}_{op}_hook_send", f"{t} hooked (send + recv)", "baseline",
                                   latency="send_plus_recv_us", colour=t) for t in transports]
        if op == "dispatch_fp8":
            series += [case_series(runs, "a2a_ceiling_fp8", "raw all_to_all_single (gloo)", "ceiling"),
                       case_series(runs, "a2a_ceiling_fp8_mpi", "raw MPI_Alltoallv", "ceiling")]
        series.append(floor_series(runs, f"{transports[0]}_{op}"))
        out.append(Panel(op, tuple(s for s in series if s is not None)))
    return out


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """The options (``prog``: the command's name in usage and errors)."""
    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    add_rank_args(p, ranks=4)
    add_tokens_arg(p, 128, "tokens per rank = num_max_dispatch_tokens_per_rank")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size, a multiple of 128")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=32, help="total experts, a multiple of the rank count")
    p.add_argument("--compute", type=int, default=512, help="side of the fp32 matmul overlapped with the hook")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "low_latency")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m moe_comm.bench low_latency") -> None:
    """Parses ``argv``, runs every token count on the launched (or spawned) ranks and reports."""
    launch_token_counts("low_latency", run_rank, report, parse_args(argv, prog),
                        ("hidden", "topk", "experts", "compute", "warmup", "iters", "seed", "transports"),
                        command_line(prog, argv))
