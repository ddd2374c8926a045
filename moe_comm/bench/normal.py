"""Normal-mode benchmark: moe-comm dispatch/combine on every transport vs the naive all-gather /
reduce-scatter baseline, the raw all-to-all and the memory-copy floor.

    python -m moe_comm.bench normal --ranks 4                    # 4 local ranks (moe_comm.launch.LocalWorld)
    torchrun --nproc-per-node 4 -m moe_comm.bench normal         # launcher detected from the environment
    mpirun -n 4 python -m moe_comm.bench normal                  # adds the mpi transport and MPI_Alltoallv
    python -m moe_comm.bench normal --tokens 128 512 2048 --plot normal.png
    python -m moe_comm.bench normal --elastic                    # adds DeepEP V2's ElasticBuffer calls

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
from moe_comm.ops import per_token_cast_back, per_token_cast_to_fp8

from .checks import calc_diff, require_all_ranks
from .floors import floor_columns, memcpy_bandwidth, mpi_all_to_all, vs_transport
from .options import add_output_args, add_rank_args, add_tokens_arg, command_line
from .plot import Panel, case_series, floor_series
from .python_calls import counted
from .ranks import launch_token_counts
from .record import publish
from .stats import case_rows, gather_results, time_cases
from .table import format_table
from .transports import runs_on, split_case

__all__ = ["run_rank", "panels", "main"]

BYTE_RULE = ("DeepEP test_intranode: dispatch BF16 bytes = recv_x.numel()*2 (rows received, own rank "
             "included, x H*2 bytes; top-k ids/weights not counted); FP8 = BF16 bytes*(1+4/128)/2; combine = "
             "the BF16 dispatch bytes; dispatch+combine = twice that. naive_dispatch = bytes each rank holds after the all-gathers "
             "(R*T rows of x bf16 + topk ids int64 + weights fp32); naive_combine = the [R*T, H] bf16 "
             "tensor each rank feeds the reduce-scatter. a2a_ceiling = the BF16 dispatch bytes.")
BANDWIDTH_RULE = ("GB/s per rank = (mean over ranks of that rank's bytes) / median iteration time / 1e9; "
                  "aggregate bytes = sum over ranks (in JSON)")
#: The moe-comm ops timed on every transport (cases ``<transport>_<op>``).
OPS = ("dispatch_bf16", "dispatch_fp8", "combine_bf16", "dispatch+combine")
#: With ``--elastic``: DeepEP V2's ``ElasticBuffer`` calls on the same inputs (``_nosync``: ``do_cpu_sync=False``).
V2_OPS = ("v2_dispatch_bf16", "v2_dispatch_bf16_nosync", "v2_combine_bf16")

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of *_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------- the per-rank work
def run_rank(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Checks, then times, every case on this rank; returns the results on rank 0, else None.

    Collective over ``group``; module-level so ``LocalWorld`` can pickle it by name."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T, H, K, E = cfg["tokens"], cfg["hidden"], cfg["topk"], cfg["experts"]
    torch.manual_seed(cfg["seed"] + rank)
    x = torch.randn(T, H).bfloat16()
    topk_idx = (torch.randn(T, E).abs() + 1).topk(K, dim=1).indices  # DeepEP's routing: random top-k
    topk_weights = torch.rand(T, K)
    x_fp8, scales = per_token_cast_to_fp8(x)
    x_e4m3 = (x_fp8, scales.T.contiguous().T)  # column-major scales, as DeepEP's tests pass them

    bufs = {name: moe_comm.Buffer(group, **runs_on(name)) for name in cfg["transports"]}
    buf = bufs[cfg["transports"][0]]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                   topk_idx=topk_idx, topk_weights=topk_weights)
    checks: dict[str, float] = {}

    # --- correctness, once per transport, before anything is timed; transports must agree bitwise
    copies = in_rank.sum(1, keepdim=True).float()  # ranks each token went to
    expected = x.float() * copies
    ok, outputs = True, {}
    for name, b in bufs.items():
        recv_x, _, _, _, handle, _ = b.dispatch(x, **routing)
        combined, _, _ = b.combine(recv_x, handle)
        checks[f"{name}_combine_bf16_calc_diff"] = calc_diff(combined, expected)
        ok &= torch.allclose(combined.float(), expected, rtol=2 ** -7, atol=0)
        ok &= checks[f"{name}_combine_bf16_calc_diff"] < 5e-6
        (recv_fp8, recv_scales), _, _, _, _, _ = b.dispatch(x_e4m3, **routing)
        checks[f"{name}_dispatch_fp8_calc_diff"] = calc_diff(per_token_cast_back(recv_fp8, recv_scales), recv_x)
        ok &= checks[f"{name}_dispatch_fp8_calc_diff"] < 5e-4
        outputs[name] = (recv_x, combined, recv_fp8.view(torch.uint8), recv_scales, handle)
    first = outputs[cfg["transports"][0]]
    same = all(torch.equal(a, b) for other in outputs.values() for a, b in zip(first[:4], other[:4]))
    checks["transports_bitwise_equal"] = float(same)
    ok &= same
    recv_x, handle = first[0], first[4]
    python_calls = {name: _python_calls(b, group, x, routing) for name, b in bufs.items()}

    # naive baseline (vLLM allgather_reducescatter): every rank gets every token, computes its own
    # experts' share (here: x itself for tokens routed to it, else 0), and a reduce-scatter sums.
    def naive_dispatch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # allocated per call, as vLLM's all_gatherv does
        gx, gi, gw = torch.empty(R * T, H, dtype=x.dtype), torch.empty(R * T, K, dtype=topk_idx.dtype), \
            torch.empty(R * T, K, dtype=topk_weights.dtype)
        works = [_all_gather(o, i, group=group, async_op=True) for o, i in ((gx, x), (gi, topk_idx), (gw, topk_weights))]
        for w in works:
            w.wait()
        return gx, gi, gw

    gx, gi, _ = naive_dispatch()
    mine = ((gi // (E // R)) == rank).any(dim=1, keepdim=True)
    expert_out = gx * mine  # [R*T, H] bf16

    def naive_combine() -> torch.Tensor:
        out = torch.empty(T, H, dtype=x.dtype)
        _reduce_scatter(out, expert_out, group=group)
        return out

    naive_out = naive_combine()
    checks["naive_combine_calc_diff"] = calc_diff(naive_out, expected)
    ok &= torch.allclose(naive_out.float(), expected, rtol=2 ** -6, atol=0)

    # measured ceiling: one raw gloo all_to_all_single of exactly the bf16 dispatch payload rows,
    # pre-gathered and into a preallocated buffer (no handshake, no packing, no allocation).
    send_counts = in_rank.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_rows = x[in_rank.t().nonzero()[:, 1]]
    a2a_out = torch.empty(int(recv_counts.sum()), H, dtype=x.dtype)
    sc, rc = send_counts.tolist(), recv_counts.tolist()

    require_all_ranks(ok, "normal", rank, checks, group)

    bf16 = recv_x.shape[0] * H * 2
    bandwidth = memcpy_bandwidth(group, bf16)

    def round_trip(b: moe_comm.Buffer) -> None:
        received, _, _, _, h, _ = b.dispatch(x, **routing)
        b.combine(received, h)

    cases: dict[str, Callable[[], Any]] = {}
    mine_bytes: dict[str, float] = {}  # bytes each rank accounts for, gathered for mean and aggregate
    for name, b in bufs.items():
        cases.update({f"{name}_dispatch_bf16": functools.partial(b.dispatch, x, **routing),
                      f"{name}_dispatch_fp8": functools.partial(b.dispatch, x_e4m3, **routing),
                      f"{name}_combine_bf16": functools.partial(b.combine, recv_x, handle),
                      f"{name}_dispatch+combine": functools.partial(round_trip, b)})
        mine_bytes.update({f"{name}_dispatch_bf16": bf16, f"{name}_dispatch_fp8": bf16 * (1 + 4 / 128) / 2,
                           f"{name}_combine_bf16": bf16, f"{name}_dispatch+combine": 2 * bf16})
    cases.update({"naive_dispatch": naive_dispatch, "naive_combine": naive_combine,
                  "a2a_ceiling": lambda: dist.all_to_all_single(a2a_out, send_rows, rc, sc, group=group)})
    mine_bytes.update({"naive_dispatch": R * T * (2 * H + 8 * K + 4 * K), "naive_combine": R * T * H * 2,
                       "a2a_ceiling": bf16})
    if "mpi" in bufs:
        cases["a2a_ceiling_mpi"] = mpi_all_to_all(a2a_out, send_rows, rc, sc)
        mine_bytes["a2a_ceiling_mpi"] = bf16
    if cfg.get("elastic"):
        ok &= _elastic_cases(group, cfg, x, topk_idx, topk_weights, outputs, expected, checks, cases, mine_bytes, bf16)
        require_all_ranks(ok, "normal (ElasticBuffer)", rank, checks, group)
    times = time_cases(cases, group, cfg["warmup"], cfg["iters"])
    res = gather_results(times, mine_bytes, checks, group)
    if res is None:
        return None
    return {**res, "recv_rows_rank0": recv_x.shape[0], "python_calls_rank0": python_calls,
            "threads_per_rank": torch.get_num_threads(),
            "kernel_threads_per_rank": cpu_threads(), "memcpy_GBps": bandwidth}


def _python_calls(buf: moe_comm.Buffer, group: dist.ProcessGroup, x: torch.Tensor,
                  routing: dict[str, Any]) -> dict[str, int]:
    """Python calls of a BF16 dispatch and of its combine on this rank's thread, each after a barrier: the
    second call of each, as every layer's call after the first (which prepares its signature) makes them."""
    calls: dict[str, int] = {}
    dispatch = functools.partial(buf.dispatch, x, **routing)
    for _ in range(2):
        dist.barrier(group)
        (recv, _, _, _, handle, _), calls["dispatch"] = counted(dispatch)
        dist.barrier(group)
        _, calls["combine"] = counted(functools.partial(buf.combine, recv, handle))
    return calls


def _elastic_cases(group: dist.ProcessGroup, cfg: dict[str, Any], x: torch.Tensor, topk_idx: torch.Tensor,
                   topk_weights: torch.Tensor, outputs: dict[str, Any], expected: torch.Tensor,
                   checks: dict[str, float], cases: dict[str, Callable[[], Any]], mine_bytes: dict[str, float],
                   bf16: int) -> bool:
    """Adds DeepEP V2's calls (``ElasticBuffer``, one per transport) beside V1's, after checking that its
    dispatch receives V1's rows bitwise and its combine sums them as V1's does; returns that check."""
    ok = True
    T, E = x.shape[0], cfg["experts"]
    routing = dict(topk_idx=topk_idx, topk_weights=topk_weights, num_experts=E)
    for name in cfg["transports"]:
        eb = moe_comm.ElasticBuffer(group, num_max_tokens_per_rank=T, hidden=x.shape[1], num_topk=topk_idx.shape[1],
                                    **runs_on(name))
        v2_x, _, _, v2_handle, _ = eb.dispatch(x, **routing)
        ok &= torch.equal(v2_x, outputs[name][0])
        v2_out, _, _ = eb.combine(v2_x, v2_handle)
        checks[f"{name}_v2_combine_bf16_calc_diff"] = calc_diff(v2_out, expected)
        ok &= checks[f"{name}_v2_combine_bf16_calc_diff"] < 5e-6
        cases.update({f"{name}_v2_dispatch_bf16": functools.partial(eb.dispatch, x, **routing),
                      f"{name}_v2_dispatch_bf16_nosync": functools.partial(eb.dispatch, x, do_cpu_sync=False,
                                                                           **routing),
                      f"{name}_v2_combine_bf16": functools.partial(eb.combine, v2_x, v2_handle)})
        mine_bytes.update({f"{name}_{op}": bf16 for op in V2_OPS})
    return ok


# ---------------------------------------------------------------------------- reporting
def _rows(res: dict[str, Any], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's table rows, with the ratios against the baseline, the ceiling, collective and the floor."""
    rows = case_rows(res)
    for r in rows:
        r.update({"ranks": cfg["ranks"], "tokens": cfg["tokens"], "hidden": cfg["hidden"], "topk": cfg["topk"],
                  "experts": cfg["experts"],
                  "GBps_per_rank": r["bytes_per_rank_mean"] / (r["median_us"] * 1e-6) / 1e9})
    by = {r["case"]: r for r in rows}
    for r in rows:
        op = (split_case(r["case"]) or ("", ""))[1].removeprefix("v2_")
        base = by.get("naive_dispatch" if op.startswith("dispatch_") else "naive_combine" if op == "combine_bf16"
                      else "")
        r["vs_baseline"] = base["median_us"] / r["median_us"] if base else None
        r["vs_ceiling"] = r["GBps_per_rank"] / by["a2a_ceiling"]["GBps_per_rank"]
    vs_transport(rows)
    floor_columns(rows, res["memcpy_GBps"], OPS + V2_OPS)
    return rows


def _notes(res: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """What one run's columns mean, with the floor's measured bandwidth and the threads."""
    return [
        "case names are <transport>_<op>: the same Buffer API over the collective (gloo all_to_all_single), "
        "shm (shared memory) and mpi (MPI Ialltoallv through mpi4py) transports and the cuda_host backend; "
        "vs_collective = collective median / this row's median for the same op",
        f"memory-copy floor: the bytes each rank must receive / single-thread memcpy bandwidth (the faster of libc memcpy and torch copy_) measured in "
        f"this run with every rank copying at once ({res['memcpy_GBps']['concurrent']:.2f} GB/s per rank; one "
        f"rank alone: {res['memcpy_GBps']['alone']:.2f} GB/s, see of_floor_alone in JSON); floor/median = 1.0 "
        f"would be as fast as one memcpy of the received bytes",
        "Python calls per op, rank 0's thread, a call after the first of its signature: " + "; ".join(
            f"{name}: dispatch {c['dispatch']}, combine {c['combine']}"
            for name, c in res["python_calls_rank0"].items()),
        "vs_naive = naive median time / case median time; dispatch cases vs naive_dispatch, "
        "combine vs naive_combine (FP8 dispatch is compared with the BF16 naive all-gather)",
        "naive_combine uses torch.distributed.reduce_scatter_single on gloo; torch's ProcessGroupGloo implements "
        "it as an all_reduce of the whole [R*T, H] tensor followed by a copy of this rank's slice, so the wire "
        "traffic is an all-reduce's, not a true reduce-scatter's",
        "gloo sums bf16 in bf16 (naive_combine); moe-comm's combine sums in fp32 and rounds once",
        "moe-comm dispatch is non-cached with top-k ids/weights and a precomputed get_dispatch_layout "
        "(the per-layer call of an MoE forward); it includes the blocking count handshake",
        "a2a_ceiling: one raw gloo all_to_all_single of the pre-gathered BF16 dispatch rows into a preallocated "
        "buffer (a2a_ceiling_mpi: one blocking MPI_Alltoallv of the same bytes); GB/s_vs_a2a = case GB/s / "
        "a2a_ceiling GB/s",
        f"{cfg['ranks']} ranks share {os.cpu_count()} CPU cores ({res['threads_per_rank']} torch / "
        f"{res['kernel_threads_per_rank']} moe_comm._C thread(s) per rank); shared, noisy VM",
    ]


COLUMNS = [("case", "case"), ("ranks", "ranks"), ("tokens", "tokens/rank"), ("hidden", "hidden"),
           ("topk", "topk"), ("experts", "experts"), ("median_us", "median_us"), ("p10_p90", "p10/p90_us"),
           ("GBps_per_rank", "GB/s/rank"), ("vs_baseline", "vs_naive(x)"), ("vs_collective", "vs_collective(x)"),
           ("floor_us", "memcpy_floor_us"), ("of_floor", "floor/median"), ("vs_ceiling", "GB/s_vs_a2a")]


def report(results: list[dict[str, Any]], command: str, launcher: str, *, cfgs: Sequence[dict[str, Any]],
           json_path: str, plot_path: Optional[str]) -> None:
    """Prints a table per run (token count) and writes the JSON record, and the plot if asked (rank 0 only)."""
    runs = []
    for res, cfg in zip(results, cfgs):
        rows, notes = _rows(res, cfg), _notes(res, cfg)
        print(f"== normal: {cfg['tokens']} tokens/rank")
        print(format_table(COLUMNS, rows))
        for r in rows:
            r.pop("p10_p90")  # table only; JSON has the numbers
        print("\n".join(notes[:3]))
        print(f"\nbytes: per rank (mean over ranks); {BANDWIDTH_RULE}\nchecks (max over ranks): "
              f"{ {k: f'{v:.2e}' for k, v in res['checks_max_over_ranks'].items()} }\n")
        runs.append({"tokens": cfg["tokens"], "threads_per_rank": res["threads_per_rank"],
                     "kernel_threads_per_rank": res["kernel_threads_per_rank"], "notes": notes,
                     "memcpy_GBps": res["memcpy_GBps"], "checks_max_over_ranks": res["checks_max_over_ranks"],
                     "cases": rows})
    record = {"bench": "normal", "command": command, "launcher": launcher,
              "config": {**cfgs[0], "tokens": [c["tokens"] for c in cfgs]}, "byte_rule": BYTE_RULE,
              "bandwidth_rule": BANDWIDTH_RULE, "timing": "per iteration: dist.barrier, then perf_counter around "
              "the op (async_finish=False); max over ranks; stats over iterations", "runs": runs}
    title = (f"normal mode: {cfgs[0]['ranks']} ranks, hidden {cfgs[0]['hidden']}, top-{cfgs[0]['topk']} of "
             f"{cfgs[0]['experts']} experts")
    publish(record, json_path, plot_path, title, panels)


def panels(record: dict[str, Any]) -> list[Panel]:
    """The plot of a JSON record: one panel per op, a line per transport, the naive baseline (latency
    only: its bytes are counted differently) and the raw all-to-alls where they move the same bytes
    (BF16 dispatch and combine), and the memory-copy floor."""
    runs = [(run["tokens"], {r["case"]: r for r in run["cases"]}) for run in record["runs"]]
    transports = record["config"]["transports"]
    out = []
    for op in OPS:
        series = [case_series(runs, f"{t}_{op}", t, "ours") for t in transports]
        naive = {"dispatch_bf16": "naive_dispatch", "dispatch_fp8": "naive_dispatch", "combine_bf16": "naive_combine"}
        if op in naive:
            series.append(case_series(runs, naive[op], f"{naive[op]} (all-gather / reduce-scatter)", "baseline",
                                      rate=None))
        if op in ("dispatch_bf16", "combine_bf16"):
            series += [case_series(runs, "a2a_ceiling", "raw all_to_all_single (gloo)", "ceiling"),
                       case_series(runs, "a2a_ceiling_mpi", "raw MPI_Alltoallv", "ceiling")]
        series.append(floor_series(runs, f"{transports[0]}_{op}"))
        out.append(Panel(op, tuple(s for s in series if s is not None)))
    return out


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """The options (``prog``: the command's name in usage and errors)."""
    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    add_rank_args(p, ranks=2)
    add_tokens_arg(p, 512, "tokens per rank")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size, a multiple of 128 (FP8 scales)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64, help="total experts, a multiple of the rank count")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--elastic", action="store_true",
                   help="also time DeepEP V2's ElasticBuffer dispatch and combine on the same inputs")
    add_output_args(p, "normal")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m moe_comm.bench normal") -> None:
    """Parses ``argv``, runs every token count on the launched (or spawned) ranks and reports."""
    launch_token_counts("normal", run_rank, report, parse_args(argv, prog),
                        ("hidden", "topk", "experts", "warmup", "iters", "seed", "transports", "elastic"),
                        command_line(prog, argv))
