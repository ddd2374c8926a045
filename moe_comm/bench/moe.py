"""EP-MoE layer benchmark: every mode of ``moe_comm.ep_moe`` on every transport, side by side.

    python -m moe_comm.bench moe --ranks 2                       # local ranks (moe_comm.launch.LocalWorld)
    torchrun --nproc-per-node 2 -m moe_comm.bench moe            # launcher detected from the environment
    mpirun -n 2 python -m moe_comm.bench moe
    python -m moe_comm.bench moe --tokens 128 512 --plot moe.png

Per (transport, mode): the layer's time; its communication alone (the mode's schedule with the
experts replaced by a ready output); its compute alone (the experts on the micro-batches that
arrived); and overlap efficiency = (t_comm + t_comp - t_layer) / min(t_comm, t_comp), 0 for none, 1
when the shorter part is hidden completely. ``cpu/wall`` is the CPU time a rank's process used per
second of the case (1.0 = one core busy), which shows whether communication leaves a core free for
compute to overlap into; ``overlap_bound`` is the speed-up a perfect overlap could reach on that
basis. Outputs are checked bit for bit against ``ep_moe_reference`` before timing. With ``--compile``,
each (transport, mode) also times the layer compiled (``torch.compile(EPMoE, fullgraph=True,
dynamic=True)``, checked bit for bit like the eager one) and reports its compile time (the first
call's, the slowest rank).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.core.native import cpu_threads
from moe_comm.moe import MODES, Experts, NormalStages, ep_moe, ep_moe_reference, schedules

from .checks import require_all_ranks
from .options import add_output_args, add_rank_args, add_tokens_arg, command_line
from .plot import Panel, Series
from .ranks import launch_token_counts
from .record import publish
from .stats import case_rows, gather_results, percentile, time_cases
from .table import format_table
from .transports import runs_on

__all__ = ["run_rank", "panels", "main"]


def _inputs(cfg: dict[str, Any], ranks: int) -> tuple[Experts, list[torch.Tensor], list[torch.Tensor],
                                                      list[torch.Tensor]]:
    """All experts and every rank's (x, topk_idx, topk_weights), from the seed (the same on every rank)."""
    T, H, I, K, E = cfg["tokens"], cfg["hidden"], cfg["inter"], cfg["topk"], cfg["experts"]
    gen = torch.Generator().manual_seed(cfg["seed"])
    w13 = torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=gen) / math.sqrt(I)
    experts = Experts.quantized(w13, w2) if cfg["fp8"] else Experts(w13.bfloat16(), w2.bfloat16())
    xs = [torch.randn(T, H, generator=gen).bfloat16() for _ in range(ranks)]
    idxs = [torch.rand(T, E, generator=gen).topk(K, dim=1).indices for _ in range(ranks)]
    weights = [torch.rand(T, K, generator=gen) for _ in range(ranks)]
    return experts, xs, idxs, weights


class _CommOnly:
    """A mode's stages with the experts replaced by a zero output of the right shape (communication alone)."""

    def __init__(self, stages: Any) -> None:
        self._stages, self._outputs = stages, {}
        self.dispatch, self.combine = stages.dispatch, stages.combine

    def compute(self, received: Any) -> torch.Tensor:
        received.wait()
        shape = (received.x.shape[0], received.x.shape[1]) if isinstance(self._stages, NormalStages) \
            else tuple(received.x.shape)
        if shape not in self._outputs:
            self._outputs[shape] = torch.zeros(shape, dtype=torch.bfloat16)
        return self._outputs[shape]


class _Recording:
    """A mode's stages that keep what each compute step received (to time the compute alone)."""

    def __init__(self, stages: Any) -> None:
        self.stages, self.received = stages, []
        self.dispatch, self.combine = stages.dispatch, stages.combine

    def compute(self, received: Any) -> torch.Tensor:
        out = self.stages.compute(received)
        self.received.append(received)
        return out


def run_rank(group: dist.ProcessGroup, cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Checks, then times, every (transport, mode) on this rank; returns the results on rank 0, else None."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    T, H, E, chunks = cfg["tokens"], cfg["hidden"], cfg["experts"], cfg["num_chunks"]
    experts, xs, idxs, weights = _inputs(cfg, R)
    local = E // R
    mine = experts.select(rank * local, local)
    x, idx, w = xs[rank], idxs[rank], weights[rank]
    m = T  # low-latency M: the whole batch fits one micro-batch
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(m, H, R, E)
    bufs = {name: moe_comm.Buffer(group, **runs_on(name), low_latency_mode=True, num_rdma_bytes=hint)
            for name in cfg["transports"]}

    checks: dict[str, float] = {}
    cases: dict[str, Callable[[], Any]] = {}
    compile_s: dict[str, float] = {}
    for mode in cfg["modes"]:
        expected = ep_moe_reference(xs, idxs, weights, experts, mode, chunks)[rank]
        for name in cfg["transports"]:
            out = ep_moe(bufs[name], x, idx, w, mine, E, mode=mode, num_chunks=chunks,
                         num_max_dispatch_tokens_per_rank=m)
            checks[f"{name}_{mode}_mismatched"] = float(not torch.equal(out.view(torch.int16),
                                                                        expected.view(torch.int16)))
            recording = _Recording(schedules.stages_for(mode, bufs[name], mine, E, m))
            schedules.run(mode, recording, x, idx, w, chunks)
            comm_only = _CommOnly(schedules.stages_for(mode, bufs[name], mine, E, m))
            cases[f"{name}_{mode}_layer"] = functools.partial(ep_moe, bufs[name], x, idx, w, mine, E, mode=mode,
                                                              num_chunks=chunks, num_max_dispatch_tokens_per_rank=m)
            cases[f"{name}_{mode}_comm"] = functools.partial(schedules.run, mode, comm_only, x, idx, w, chunks)
            cases[f"{name}_{mode}_compute"] = functools.partial(
                lambda stages, got: [stages.compute(r) for r in got], recording.stages, recording.received)
            if cfg["compile"]:
                # Every (transport, mode) is another EPMoE on the one code object EPMoE.forward: raise Dynamo's
                # limit of compiled versions per code object (8) above their count, and drop the versions of
                # an earlier token count's buffers. (Layers of one model that share a Buffer and a mode share
                # one compiled version.)
                if not compile_s:
                    torch._dynamo.reset()
                limit = len(cfg["transports"]) * len(cfg["modes"]) + 1
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
                compiled = torch.compile(moe_comm.EPMoE(bufs[name], mine, E, mode=mode, num_chunks=chunks,
                                                        num_max_dispatch_tokens_per_rank=m), fullgraph=True,
                                         dynamic=True)
                start = time.perf_counter()
                out = compiled(x, idx, w)
                compile_s[f"{name}_{mode}"] = time.perf_counter() - start
                checks[f"{name}_{mode}_compiled_mismatched"] = float(not torch.equal(out.view(torch.int16),
                                                                                     expected.view(torch.int16)))
                cases[f"{name}_{mode}_compiled"] = functools.partial(compiled, x, idx, w)
    require_all_ranks(not any(checks.values()), "moe", rank, checks, group)

    cpu: dict[str, list[float]] = {name: [] for name in cases}

    def with_cpu(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            start = time.process_time()
            result = fn()
            cpu[name].append(time.process_time() - start)
            return result
        return timed

    times = time_cases({n: with_cpu(n, fn) for n, fn in cases.items()}, group, cfg["warmup"], cfg["iters"])
    cpu_median = torch.tensor([percentile(cpu[n][cfg["warmup"]:], 50) for n in cases], dtype=torch.float64)
    dist.all_reduce(cpu_median, group=group)  # mean over ranks, below
    slowest_compile = torch.tensor(list(compile_s.values()), dtype=torch.float64)
    dist.all_reduce(slowest_compile, op=dist.ReduceOp.MAX, group=group)
    res = gather_results(times, {n: 0.0 for n in cases}, checks, group)
    if res is None:
        return None
    res["cpu_s"] = dict(zip(cases, (cpu_median / R).tolist()))
    res["compile_s"] = dict(zip(compile_s, slowest_compile.tolist()))
    return {**res, "threads_per_rank": torch.get_num_threads(), "kernel_threads_per_rank": cpu_threads()}


def _rows(res: dict[str, Any], cfg: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """One run's rows, one per (transport, mode), and its notes."""
    by = {r["case"]: r for r in case_rows(res)}
    cores = min(1.0, (os.cpu_count() or 1) / cfg["ranks"])  # a rank runs one torch thread: at most one core
    rows = []
    for name in cfg["transports"]:
        for mode in cfg["modes"]:
            layer, comm, comp = (by[f"{name}_{mode}_{part}"] for part in ("layer", "comm", "compute"))
            t_layer, t_comm, t_comp = layer["median_us"], comm["median_us"], comp["median_us"]
            cpu_comm, cpu_comp = (res["cpu_s"][part["case"]] * 1e6 for part in (comm, comp))
            rows.append({"transport": name, "mode": mode, "layer_us": t_layer, "comm_us": t_comm, "compute_us": t_comp,
                         "sum_us": t_comm + t_comp,
                         "overlap_eff": (t_comm + t_comp - t_layer) / min(t_comm, t_comp),
                         "layer_p10_p90": layer["p10_p90"],
                         "cpu_per_wall_layer": res["cpu_s"][layer["case"]] / (t_layer * 1e-6),
                         "cpu_per_wall_comm": cpu_comm / t_comm, "cpu_per_wall_compute": cpu_comp / t_comp,
                         # both parts' CPU time still runs on the rank's share of the cores
                         "overlap_bound": (t_comm + t_comp) / max(t_comm, t_comp, (cpu_comm + cpu_comp) / cores),
                         "times_us": {part: by[f"{name}_{mode}_{part}"]["times_us"]
                                      for part in ("layer", "comm", "compute")}})
            if f"{name}_{mode}_compiled" in by:
                compiled = by[f"{name}_{mode}_compiled"]
                rows[-1].update(compiled_us=compiled["median_us"], compiled_vs_eager=t_layer / compiled["median_us"],
                                compile_s=res["compile_s"][f"{name}_{mode}"])
                rows[-1]["times_us"]["compiled"] = compiled["times_us"]
    base = {r["transport"]: r["layer_us"] for r in rows if r["mode"] == "sequential"}
    for r in rows:
        if r["transport"] in base and r["mode"] in ("sequential", "chunked"):
            r["vs_sequential"] = base[r["transport"]] / r["layer_us"]
    notes = [f"{cfg['ranks']} ranks x {cfg['tokens']} tokens, hidden {cfg['hidden']}, intermediate {cfg['inter']}, "
             f"top-{cfg['topk']} of {cfg['experts']} experts, {'FP8' if cfg['fp8'] else 'BF16'} experts; chunked mode: "
             f"{cfg['num_chunks']} chunks; low-latency M = tokens per rank",
             "overlap_eff = (comm_alone + compute_alone - layer) / min(comm_alone, compute_alone); medians of the "
             "per-iteration max over ranks; cases take turns each iteration",
             "cpu/wall: a rank's process CPU seconds (all its threads) per wall second, mean over ranks",
             "overlap_bound = (comm_alone + compute_alone) / max(comm_alone, compute_alone, (CPU seconds of both) / "
             "cores per rank): the most a perfect overlap could gain over running the parts back to back, since the "
             "communication's own CPU work (copies, TCP, polling) runs on the same cores as the compute "
             f"(cores per rank here: {cores:g})",
             f"{cfg['ranks']} ranks share {os.cpu_count()} CPU cores ({res['threads_per_rank']} torch / "
             f"{res['kernel_threads_per_rank']} moe_comm._C thread(s) per rank); shared, noisy VM"]
    return rows, notes


COLUMNS = [("transport", "transport"), ("mode", "mode"), ("layer_us", "layer_us"),
           ("layer_p10_p90", "layer p10/p90"), ("comm_us", "comm_alone_us"), ("compute_us", "compute_alone_us"),
           ("sum_us", "comm+compute_us"), ("overlap_eff", "overlap_eff"), ("vs_sequential", "vs_sequential(x)"),
           ("cpu_per_wall_comm", "cpu/wall comm"), ("cpu_per_wall_compute", "cpu/wall compute"),
           ("cpu_per_wall_layer", "cpu/wall layer"),
           ("overlap_bound", "overlap_bound(x)"), ("compiled_us", "compiled_us"),
           ("compiled_vs_eager", "eager/compiled(x)"), ("compile_s", "compile_s")]


def report(results: list[dict[str, Any]], command: str, launcher: str, *, cfgs: Sequence[dict[str, Any]],
           json_path: str, plot_path: Optional[str]) -> None:
    """Prints a table per run (token count) and writes the JSON record, and the plot if asked (rank 0 only)."""
    runs = []
    for res, cfg in zip(results, cfgs):
        rows, notes = _rows(res, cfg)
        print(f"== moe: {cfg['tokens']} tokens/rank")
        print(format_table(COLUMNS, rows))
        print("\n".join(notes) + "\n")
        for r in rows:
            r.pop("layer_p10_p90")
        runs.append({"tokens": cfg["tokens"], "notes": notes, "checks_max_over_ranks": res["checks_max_over_ranks"],
                     "rows": rows})
    record = {"bench": "moe", "command": command, "launcher": launcher,
              "config": {**cfgs[0], "tokens": [c["tokens"] for c in cfgs]}, "runs": runs}
    c = cfgs[0]
    title = (f"EP-MoE layer: {c['ranks']} ranks, hidden {c['hidden']}, intermediate {c['inter']}, "
             f"top-{c['topk']} of {c['experts']} {'FP8' if c['fp8'] else 'BF16'} experts")
    publish(record, json_path, plot_path, title, panels)


def panels(record: dict[str, Any]) -> list[Panel]:
    """The plot of a JSON record: one panel per mode, latency only (no bytes are counted): the layer per
    transport, with its communication alone and its compute alone in the same colour."""
    out = []
    for mode in record["config"]["modes"]:
        series = []
        for t in record["config"]["transports"]:
            for key, label, kind, marker in (("layer_us", t, "ours", ""), ("comm_us", f"{t} comm alone", "part", "v"),
                                             ("compute_us", f"{t} compute alone", "part", "D")):
                points = tuple(sorted((run["tokens"], r[key], None) for run in record["runs"] for r in run["rows"]
                                      if (r["transport"], r["mode"]) == (t, mode)))
                series.append(Series(label, kind, points, colour=t, marker=marker))
        out.append(Panel(f"mode {mode}", tuple(s for s in series if s.points)))
    return out


def parse_args(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> argparse.Namespace:
    """The options (``prog``: the command's name in usage and errors)."""
    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    add_rank_args(p, ranks=2)
    add_tokens_arg(p, 512, "tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=256, help="expert intermediate size (a multiple of 128 for FP8)")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--experts", type=int, default=16, help="total experts, a multiple of the rank count")
    p.add_argument("--num-chunks", type=int, default=4, help="micro-batches of the chunked mode")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (128x128 block scales) and FP8 dispatch")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="also time the layer under torch.compile(fullgraph=True, dynamic=True), and its compile time")
    add_output_args(p, "moe")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m moe_comm.bench moe") -> None:
    """Parses ``argv``, runs every token count on the launched (or spawned) ranks and reports."""
    launch_token_counts("moe", run_rank, report, parse_args(argv, prog),
                        ("hidden", "inter", "topk", "experts", "num_chunks", "fp8", "modes", "warmup", "iters", "seed",
                         "transports", "compile"), command_line(prog, argv))
