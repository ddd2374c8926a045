"""vLLM's decode step time over moe-comm, and the share of it spent inside moe-comm's buffer calls.

    .venv-vllm/bin/python bench/vllm_decode.py --hidden 2048 --backend deepep_low_latency --transport shm
    .venv-vllm/bin/python bench/vllm_decode.py --hidden 2048 --backend none     # one process, no EP: the reference

Needs vLLM 0.32 (``make .venv-vllm/.engines-installed``). Runs ``LLM.generate`` on the engine tests' random
Qwen3-MoE (``tests/helpers/engines``: ``tiny_moe``, 2 layers, 8 experts, top-2, at ``--hidden``; the tests'
engine settings, eager) under ``torchrun --nproc-per-node 2``: 2 data-parallel ranks with expert parallelism
and ``all2all_backend=--backend``, ``MOE_COMM_DEEP_EP=1``, ``MOE_COMM_TRANSPORT=--transport``, the rest of the
environment as vLLM makes it. ``--backend none`` is one process with the whole model. Each rank generates
``--prompts`` random prompts of ``--prompt-len`` tokens for ``--decode`` tokens each (EOS ignored): the first
step prefills, every later one decodes one token per prompt.

Timing is vLLM's own step loop (``LLM.generate`` calls ``LLMEngine.step`` until no rank has work): a step lasts
from its start to the next step's start, so it includes the data-parallel check between steps. The prefill
step, the next ``--warmup`` steps and the last one (which has no next start) are left out; the table gives each
rank's median, p10 and p90 over the rest. moe-comm's share is the wall time, over those steps, inside the
public calls of its buffers (``TIMED``), the receive hooks they return and ``EventHandle.current_stream_wait``
(where an asynchronous call finishes on the CPU), on the thread that runs the steps, a call made inside
another counted once, divided by the steps' time. The timers are installed in each rank before the engine is
built and wrap only that public API, so they do not depend on how moe-comm does the work.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the engine tests' model, engine settings and torchrun runner

import moe_comm  # noqa: E402
from moe_comm.bench.record import write_json  # noqa: E402
from moe_comm.bench.stats import percentile  # noqa: E402
from moe_comm.bench.table import format_table  # noqa: E402

from helpers.engines import serving, tiny_moe  # noqa: E402
from helpers.engines.vllm_generate import engine_kwargs  # noqa: E402

BACKENDS = ("deepep_high_throughput", "deepep_low_latency", "deepep_v2", "none")
RANKS = 2
#: moe-comm's public buffer calls that an engine makes, by class name (``moe_comm.<name>``).
TIMED = {"Buffer": ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine"),
         "ElasticBuffer": ("dispatch", "combine"), "EventHandle": ("current_stream_wait",)}


class BufferTimer:
    """Wall time inside moe-comm's ``TIMED`` calls and the hooks they return, on the thread that made this timer.

    Calls on other threads are only counted (``elsewhere``); a timed call made while another runs on this thread
    (ElasticBuffer on Buffer, a wait inside a call) is part of the outer one's time, not added again.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # by call, like ``calls``
        self.elsewhere = 0
        self._thread = threading.get_ident()
        self._inside = False

    def install(self) -> None:
        """Wraps the ``TIMED`` methods of moe-comm's classes, for every instance made afterwards and before."""
        for cls_name, methods in TIMED.items():
            cls = getattr(moe_comm, cls_name)
            for method in methods:
                setattr(cls, method, self._timed(getattr(cls, method), f"{cls_name}.{method}"))

    def _timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                self.elsewhere += 1
                return fn(*args, **kwargs)
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self._inside = False
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
            if isinstance(result, tuple):  # DeepEP's receive hooks are the callables among a call's results
                result = tuple(self._timed(item, f"{name}.hook") if callable(item) else item for item in result)
            return result
        return timed


def prompts_of(rank: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` random token-id prompts of ``length`` ids, drawn from ``seed`` and ``rank``."""
    draw = random.Random(seed * 1000 + rank)
    return [[draw.randrange(4, tiny_moe.VOCAB) for _ in range(length)] for _ in range(count)]  # 0-3: special ids


def _since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What each counter of ``after`` grew by since ``before``, the counters that grew."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def child(cfg: dict[str, Any], out_dir: Path) -> None:
    """One torchrun rank: builds the engine with the timers installed, generates, writes ``rank<r>.json``."""
    launched = os.environ.get("LOCAL_WORLD_SIZE")  # before vLLM's CPU platform rewrites it
    timer = BufferTimer()
    timer.install()
    import torch
    from vllm import LLM, SamplingParams

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    llm = LLM(model=cfg["model"], **engine_kwargs(world, cfg["backend"]))
    marks: list[tuple[float, dict[str, int], dict[str, float]]] = []  # at each step's start: time, the timer's counts
    step = llm.llm_engine.step

    def marked_step() -> Any:
        marks.append((time.perf_counter(), dict(timer.calls), dict(timer.seconds)))
        return step()

    llm.llm_engine.step = marked_step
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_of(rank, cfg["prompts"], cfg["prompt_len"],
                                                                        cfg["seed"])],
                           SamplingParams(max_tokens=cfg["decode"], temperature=0, ignore_eos=True), use_tqdm=False)
    generated = [len(out.outputs[0].token_ids) for out in outputs]
    if generated != [cfg["decode"]] * cfg["prompts"] or len(marks) != cfg["decode"]:
        raise RuntimeError(f"vllm_decode: rank {rank} generated {generated} tokens in {len(marks)} steps; expected "
                           f"{cfg['decode']} each in {cfg['decode']} steps (one prefill, then one token a step)")
    periods = list(zip(marks, marks[1:]))
    record = {"rank": rank, "local_world_size": {"torchrun": launched, "vllm": os.environ.get("LOCAL_WORLD_SIZE")},
              "torch_threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)),
              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MOE_COMM_", "VLLM_CPU", "OMP_"))},
              "step_s": [b[0] - a[0] for a, b in periods], "calls": [_since(a[1], b[1]) for a, b in periods],
              "moe_comm_s": [_since(a[2], b[2]) for a, b in periods], "calls_elsewhere": timer.elsewhere}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


def summarize_rank(record: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """One table row: the measured steps' median, p10, p90 (ms), per token, moe-comm's time and share, calls."""
    first = 1 + cfg["warmup"]  # after the prefill step and the warm-up
    steps = record["step_s"][first:]
    inside = [sum(by_call.values()) for by_call in record["moe_comm_s"][first:]]
    calls: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    for step_calls, step_seconds in zip(record["calls"][first:], record["moe_comm_s"][first:]):
        calls.update(step_calls)
        seconds.update(step_seconds)
    median = percentile(steps, 50) * 1e3
    return {"rank": record["rank"], "steps": len(steps), "median_ms": median, "p10_ms": percentile(steps, 10) * 1e3,
            "p90_ms": percentile(steps, 90) * 1e3, "ms_per_token": median / cfg["prompts"],
            "moe_comm_median_ms": percentile(inside, 50) * 1e3, "moe_comm_share": sum(inside) / sum(steps),
            "calls_per_step": {k: n / len(steps) for k, n in sorted(calls.items())},
            "ms_per_step_by_call": {k: s * 1e3 / len(steps) for k, s in sorted(seconds.items())}}


def run(cfg: dict[str, Any], json_path: str) -> int:
    """Runs the ranks, prints the table (or each rank's error), writes the JSON; returns the exit status."""
    ranks = 1 if cfg["backend"] == "none" else RANKS
    # the reference process gets the threads of one EP rank (torchrun's default for several ranks: 1): its step is
    # then one rank's work (attention of its prompts, expert FLOPs of as many tokens) without the exchange
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or RANKS) // RANKS)))}
    if ranks > 1:
        env.update(MOE_COMM_DEEP_EP="1", MOE_COMM_TRANSPORT=cfg["transport"])
    with tempfile.TemporaryDirectory(prefix="vllm_decode_") as tmp:
        model = tiny_moe.save(Path(tmp) / "model", cfg["hidden"])
        child_args = [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()] + ["--child", tmp, "--model", str(model)]
        start = time.monotonic()
        done = serving.run_ranks(Path(__file__), child_args, ranks, env)
        wall_s = time.monotonic() - start
        records = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    record: dict[str, Any] = {"bench": "vllm_decode", "command": " ".join([Path(sys.executable).name] + sys.argv),
                              "config": cfg, "ranks": ranks, "returncode": done.returncode, "wall_s": wall_s}
    print(f"vLLM decode, hidden {cfg['hidden']}, backend {cfg['backend']}"
          + ("" if ranks == 1 else f", transport {cfg['transport']}, {ranks} DP ranks + EP")
          + f": {cfg['prompts']} prompts of {cfg['prompt_len']} tokens a rank, {cfg['decode']} tokens each; "
            f"{os.cpu_count()} CPU cores")
    if done.returncode:
        record["errors"] = serving.rank_errors(done.stderr) or done.stderr.splitlines()[-20:]
        print("FAILED (exit status %d):\n%s" % (done.returncode, "\n".join(record["errors"])))
    else:
        rows = [summarize_rank(r, cfg) for r in records]
        columns = [("rank", "rank"), ("steps", "steps"), ("median_ms", "step_ms"), ("p10_ms", "p10_ms"),
                   ("p90_ms", "p90_ms"), ("ms_per_token", "ms/token"), ("moe_comm_median_ms", "moe_comm_ms"),
                   ("moe_comm_share", "moe_comm_share")]
        print(format_table(columns, rows))
        for r in records:
            print(f"rank {r['rank']}: LOCAL_WORLD_SIZE {r['local_world_size']}, {r['torch_threads']} torch threads, "
                  f"CPUs {r['cpus']}, calls on other threads {r['calls_elsewhere']}")
        record.update(results=rows, per_rank=records)
    print(f"wrote {write_json(json_path, record)}")
    return 1 if done.returncode else 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--backend", choices=BACKENDS, default="deepep_low_latency")
    p.add_argument("--transport", choices=("shm", "collective"), default="shm")
    p.add_argument("--prompts", type=int, default=4, help="prompts a rank")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--decode", type=int, default=48, help="tokens generated a prompt: one prefill step, then decode")
    p.add_argument("--warmup", type=int, default=8, help="decode steps left out after the prefill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default: bench/out/vllm_decode_<hidden>_<backend>[_<transport>].json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one torchrun rank, its output folder
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # internal: the model the parent wrote
    args = p.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("hidden", "backend", "transport", "prompts", "prompt_len", "decode", "warmup",
                                         "seed")}
    limits = engine_kwargs(RANKS, args.backend)
    if args.prompts * args.prompt_len > limits["max_num_batched_tokens"] or args.prompts > limits["max_num_seqs"] \
            or args.prompt_len + args.decode > limits["max_model_len"] or args.decode < args.warmup + 3:
        p.error(f"the prefill must fit one step (prompts x prompt-len <= {limits['max_num_batched_tokens']}, prompts "
                f"<= {limits['max_num_seqs']}), prompt-len + decode <= {limits['max_model_len']}, and decode >= "
                f"warmup + 3 (the prefill, the last step and at least one measured step)")
    if args.child:
        child({**cfg, "model": args.model}, Path(args.child))
        return
    name = f"{args.hidden}_{args.backend}" + ("" if args.backend == "none" else f"_{args.transport}")
    raise SystemExit(run(cfg, args.json or str(ROOT / "bench" / "out" / f"vllm_decode_{name}.json")))


if __name__ == "__main__":  # vLLM starts processes by spawn, which re-imports this file
    main()
