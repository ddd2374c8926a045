"""Elastic expert parallelism on CPU ranks: a decode loop loses a rank (kill -9), keeps serving, and takes a
relaunched process back in, with ``moe_comm.EPMoE`` in low-latency mode over an ``enable_shrink`` Buffer.

This script is the launcher and its ranks. The launcher hosts the job's rendezvous store (as torchrun's
agent does: it must outlive every rank), starts 4 ranks, and each rank runs a decode loop of an MoE layer
(top-8 of 32 experts). By default rank 2 is killed with SIGKILL at the start of step 8; the survivors' step
8 masks it (its experts drop out of every token's top-k), and they keep stepping. At step 12 the launcher
starts a replacement process for rank 2 with ``MOE_COMM_REJOIN=1``: it loads rank 2's experts, builds its
Buffer (which returns once the survivors admitted it, at one of their dispatches) and its layer, and joins
the loop at the step the survivors are in. Then rank 1 is lost at step 24 and replaced at step 28. The loop
runs 45 steps, and on until every rank has been in for two steps.

Every rank checks every step's output against the same layer computed with every live expert in one process
(``moe_comm.moe.ep_moe_reference``; the masked ranks send no tokens, and their experts drop out of the others'
routing): bitwise. The launcher prints a table, per step, of the ranks that took part, the step's time (the
max over ranks) and the check, each admission's parts and cost against a normal step, and exits 1 unless every
step of every live rank passed.

    python examples/elastic_decode.py                      # shm (one host), 4 ranks
    python examples/elastic_decode.py --transport collective
    python examples/elastic_decode.py --ranks-per-node 2   # two emulated nodes: shm inside, gloo between
    # a job that starts without rank 3 (a reserved slot, filled at step 3), loses ranks 2 and 1 one step
    # apart, and admits rank 2's replacement while rank 1 still has none
    python examples/elastic_decode.py --late 3:3 --kill 2:8:now,1:9:now --replace 2:12,1:18
"""
from __future__ import annotations

import time

STARTED = time.time()  # this process's start, before the imports a replacement pays for

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

#: where the ranks publish what the launcher reads (under the job's store)
_STEP, _RECORD, _IN = "elastic_decode/step", "elastic_decode/record", "elastic_decode/in"
#: held from a step's end to its record: ``_die_once_invited`` kills in a layer call or between steps only
_RECORDING = threading.Lock()


def make_model(cfg: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """The full layer, identical on every process: fp32 router [H, E] and every expert in BF16."""
    from moe_comm.moe import Experts
    H, FF, E = cfg["hidden"], cfg["ffn"], cfg["experts"]
    g = torch.Generator().manual_seed(cfg["seed"])
    router = torch.randn(H, E, generator=g) * H ** -0.5
    w13 = torch.randn(E, 2 * FF, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, FF, generator=g) * (2.0 / FF ** 0.5)
    return router, Experts(w13.bfloat16(), w2.bfloat16())


def step_inputs(cfg: dict[str, Any], step: int, ranks: int, router: torch.Tensor) -> list[tuple]:
    """Every rank's (x, topk_idx, topk_weights) of decode step ``step``: the same on every process."""
    from moe_comm.moe import select_experts
    out = []
    for r in range(ranks):
        g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step * 101 + r)
        x = torch.randn(cfg["tokens"], cfg["hidden"], generator=g).bfloat16()
        idx, w = select_experts(x.float() @ router, cfg["topk"], renormalize=True)
        out.append((x, idx, w))
    return out


def run_rank(cfg: dict[str, Any]) -> None:
    """One rank's decode loop (a first incarnation, or with MOE_COMM_REJOIN=1 a replacement)."""
    import moe_comm
    from moe_comm.moe import ep_moe_reference
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    # a replacement, or a rank that starts after the job did (until its first step is recorded)
    replacing = os.environ.get("MOE_COMM_REJOIN") == "1" or os.environ.get("ELASTIC_DECODE_LATE") == "1"
    original = os.environ.get("MOE_COMM_REJOIN") != "1"  # the first process of this rank: the one --kill applies to
    # NOTES: a replacement's world group cannot connect to the survivors' (their pairs to the dead rank are
    # gone), nor a group of a job that starts short of ranks to the ranks that never started; lazy init keeps
    # it from trying, and moe-comm never uses it for data.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=R, timeout=timedelta(seconds=60))
    E, M = cfg["experts"], cfg["tokens"]
    local = E // R
    router, experts = make_model(cfg)
    if cfg["die_in_join"]:
        _die_once_invited([rank], 0.05)  # inside the epoch's build
    if original and cfg["kill"].get(rank, (0, ""))[1] == "invite":
        _die_once_invited([r for r in range(R) if r != rank], 0.0)  # before it connects the epoch's group
    if not replacing:
        # the ranks that start with the job meet first, as a launcher's rendezvous has them: the Buffer's deadline
        # is a decode step's, and beside other load their processes come up seconds apart (imports, weights)
        late = {r for r, _ in cfg["late"]}
        store.set(f"elastic_decode/up/{rank}", "1")
        store.wait([f"elastic_decode/up/{r}" for r in range(R) if r not in late], timedelta(seconds=60))
    buf = moe_comm.Buffer(dist.group.WORLD, num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(
        M, cfg["hidden"], R, E), low_latency_mode=True, enable_shrink=True, explicitly_destroy=True,
        timeout_s=cfg["timeout"])
    admitted_at = time.time()
    layer = moe_comm.EPMoE(buf, experts.select(rank * local, local), E, mode="low_latency",
                           num_max_dispatch_tokens_per_rank=M)
    step = int(store.get(_STEP)) if replacing else 0
    status = torch.zeros(R, dtype=torch.int32)
    masked: list[int] = []
    full = 0  # steps in a row with every rank in
    # NOTES: every live rank sees the same mask after a step (the shrink protocol's promise), so they all stop
    # at the same step: at least --steps, then until every rank has been in for two steps (a replacement that
    # comes late is still admitted and checked), at most --max-steps
    while step < cfg["steps"] or (full < 2 and step < cfg["max_steps"]):
        begin, began = time.monotonic(), time.time()
        store.set(_STEP, str(step))  # every rank sets the same: where a replacement joins
        at, how = cfg["kill"].get(rank, (None, ""))
        if original and at is not None and at <= step and how != "invite" and (how == "now" or not masked):
            os.kill(os.getpid(), signal.SIGKILL)  # (unless 'now', a loss waits until every rank is back in)
        inputs = step_inputs(cfg, step, R, router)
        t0 = time.perf_counter()
        out = layer(*inputs[rank])
        seconds = time.perf_counter() - t0
        with _RECORDING:  # a kill on an invitation waits until this step is recorded (it ended on this rank)
            buf.low_latency_query_mask_buffer(status)
            masked = [r for r in range(R) if status[r]]
            full = 0 if masked else full + 1
            # the reference: every expert in one process; the masked ranks send no tokens, and their experts
            # are dropped from the routing of the others'
            live = [(x, idx, w) if r not in masked else (x[:0], idx[:0], w[:0])
                    for r, (x, idx, w) in enumerate(inputs)]
            gone = torch.tensor(masked, dtype=torch.int64)
            idxs = [torch.where((idx // local).unsqueeze(-1).eq(gone).any(-1), -1, idx) for _, idx, _ in live]
            ref = ep_moe_reference([x for x, _, _ in live], idxs, [w for _, _, w in live], experts, "low_latency")
            record = {"step": step, "rank": rank, "began": began, "seconds": seconds, "masked": masked,
                      "pid": os.getpid(), "bitwise": torch.equal(out.view(torch.int16), ref[rank].view(torch.int16)),
                      "epoch": buf.membership.epoch}
            if replacing:  # its first step: when it started, was ready, was admitted, and this step ended
                record.update(started=STARTED, ready=buf.membership.announced_at, admitted=admitted_at,
                              stepped=time.time())
            store.set(f"{_RECORD}/{step}/{rank}/{os.getpid()}", json.dumps(record))
            if replacing:
                store.set(f"{_IN}/{os.getpid()}", str(step))  # the launcher starts the next replacement after this
        replacing = False
        step += 1
        time.sleep(max(0.0, cfg["step_s"] - (time.monotonic() - begin)))  # the loop's pace: requests arrive
    store.set(f"{_RECORD}/history/{rank}/{os.getpid()}", json.dumps(buf.membership.history))
    buf.destroy()
    sys.stdout.flush()
    os._exit(0)  # the world group still holds pairs to dead ranks: tearing it down is not worth the wait


def _die_once_invited(ranks: Sequence[int], after_s: float) -> None:
    """Kills this process ``after_s`` after the survivors invited one of ``ranks`` (its own rank: a replacement
    that dies during its own join; the others: a member that dies during an admission): an invitation is
    ``invite/<rank>`` under the first elastic Buffer's prefix on the world group (the store's layout:
    docs/elastic-ep.md, "How it works")."""
    from moe_comm.transport.collective import default_store
    store, keys = default_store(), [f"moe_comm/elastic/0/1/invite/{r}" for r in ranks]

    def watch() -> None:
        while not any(store.check([key]) and store.get(key).decode() for key in keys):
            time.sleep(0.005)
        time.sleep(after_s)
        with _RECORDING:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------- the launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: dict[str, Any], env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Runs the job (see the module docstring); returns the ranks' records and the events."""
    R = cfg["ranks"]
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(R),
            "ELASTIC_DECODE_CFG": json.dumps(cfg)}
    base.pop("MOE_COMM_REJOIN", None)

    late = {rank for rank, _ in cfg["late"]}
    if late:  # the job starts short of ranks: their slots are reserved (docs/elastic-ep.md)
        base.update(MOE_COMM_MIN_RANKS=str(R - len(late)), TORCH_GLOO_LAZY_INIT="1")

    def start(rank: int, replacing: bool, die_in_join: bool = False) -> subprocess.Popen:
        extra = {"RANK": str(rank)}
        if replacing and rank in late and not any(e.get("rank") == rank for e in events):
            extra.update(ELASTIC_DECODE_LATE="1")  # its first start: it fills its reserved slot
        elif replacing:
            extra.update(MOE_COMM_REJOIN="1", TORCH_GLOO_LAZY_INIT="1")
        if die_in_join:
            extra["ELASTIC_DECODE_DIE_IN_JOIN"] = "1"
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], env={**base, **extra})

    t0 = time.monotonic()
    events: list[dict[str, Any]] = []
    procs = {r: start(r, False) for r in range(R) if r not in late}
    pending = sorted([(step, rank, die) for rank, step, die in cfg["replace"]] +
                     [(step, rank, False) for rank, step in cfg["late"]])
    deadline = time.monotonic() + cfg["job_timeout"]
    finished: dict[int, int] = {}
    joining: Optional[subprocess.Popen] = None  # the replacement (or late start) started last
    while time.monotonic() < deadline:
        at = int(store.get(_STEP)) if store.check([_STEP]) else -1
        for rank, proc in list(procs.items()):
            code = proc.poll()
            if code is not None:
                events.append({"t": time.monotonic() - t0, "rank": rank, "pid": proc.pid, "exit": code, "step": at})
                del procs[rank]
                if code == 0:
                    finished[rank] = code
        # one at a time: the next waits until the one started before has taken its first step or exited
        while pending and pending[0][0] <= at and pending[0][1] not in procs and \
                (joining is None or joining.poll() is not None or store.check([f"{_IN}/{joining.pid}"])):
            step, rank, die = pending.pop(0)
            first = not any(e.get("rank") == rank for e in events)  # a late start (else a replacement)
            procs[rank] = joining = start(rank, True, die)
            events.append({"t": time.monotonic() - t0, "rank": rank, "pid": procs[rank].pid, "started": True,
                           "step": at, "dies_in_join": die, "late": first and rank in late})
        if not procs:  # nobody left to reach the step a pending replacement waits for
            break
        time.sleep(0.02)
    for proc in procs.values():  # past the job's deadline
        proc.kill()
        events.append({"rank": -1, "pid": proc.pid, "exit": "killed: the job's deadline passed"})
    records = []
    for step in range(cfg["max_steps"]):
        records += [json.loads(store.get(k)) for k in _record_keys(store, step, events)]
    histories = {f"{r} (pid {pid})": json.loads(store.get(f"{_RECORD}/history/{r}/{pid}"))
                 for r, pid in sorted({(e["rank"], e["pid"]) for e in events if e.get("rank", -1) >= 0})
                 if store.check([f"{_RECORD}/history/{r}/{pid}"])}
    return {"records": records, "events": events, "finished": sorted(finished), "histories": histories}


def _record_keys(store: dist.Store, step: int, events: list[dict[str, Any]]) -> list[str]:
    """The keys of step ``step``'s records: one per (rank, process) that ran it."""
    pids = {(e["rank"], e["pid"]) for e in events if e.get("rank", -1) >= 0}
    return [f"{_RECORD}/{step}/{r}/{pid}" for r, pid in sorted(pids)
            if store.check([f"{_RECORD}/{step}/{r}/{pid}"])]


def table(result: dict[str, Any], cfg: dict[str, Any]) -> tuple[list[str], bool]:
    """The per-step lines and whether the job passed: every step run by every rank not masked in it,
    bitwise equal to the reference, and every process still running at the end exited cleanly."""
    R, lines, passed = cfg["ranks"], [], True
    by_step: dict[int, list[dict]] = {}
    for rec in result["records"]:
        by_step.setdefault(rec["step"], []).append(rec)
    lines.append(f"{'step':>4}  {'ranks taking part':<18}  {'masked':<8}  {'step ms (max)':>13}  {'= reference':<11}  epoch")
    for step in range(max(by_step, default=-1) + 1):
        recs = by_step.get(step, [])
        ranks = sorted(rec["rank"] for rec in recs)
        masked = sorted({r for rec in recs for r in rec["masked"]})
        ok = bool(recs) and all(rec["bitwise"] for rec in recs) and \
            sorted(set(range(R)) - set(masked)) == ranks and all(rec["masked"] == masked for rec in recs)
        passed &= ok
        ms = max((rec["seconds"] for rec in recs), default=float("nan")) * 1e3
        epochs = sorted({rec["epoch"] for rec in recs})
        lines.append(f"{step:>4}  {str(ranks):<18}  {str(masked):<8}  {ms:>13.2f}  {'bitwise' if ok else 'NO':<11}  "
                     f"{epochs}")
        if not ok:
            lines += [f"      rank {rec['rank']}: masked {rec['masked']}, bitwise {rec['bitwise']}" for rec in recs]
    for e in result["events"]:
        if "started" in e:
            lines.append(f"rank {e['rank']}: {'late start' if e.get('late') else 'replacement started'} "
                         f"(pid {e['pid']}) at step {e['step']}"
                         + (", set to die during its join" if e["dies_in_join"] else ""))
        else:
            lines.append(f"rank {e['rank']}: pid {e['pid']} exited with {e['exit']} at step {e['step']}")
    for rec in (rec for rec in result["records"] if "admitted" in rec):
        lines.append(f"rank {rec['rank']} (pid {rec['pid']}): started -> ready (imports, model, announced) "
                     f"{rec['ready'] - rec['started']:.2f} s, ready -> admitted {rec['admitted'] - rec['ready']:.2f} s, "
                     f"first joint step {rec['step']} (epoch {rec['epoch']}) done "
                     f"{rec['stepped'] - rec['started']:.2f} s after its start")
    for who, history in result["histories"].items():
        for h in history:
            lines.append(f"rank {who}: epoch {h['epoch']} ({'starting with' if h['start'] else 'admitting'} "
                         f"{h['ranks']}): {h['outcome'][:300]}, "
                         f"{h['seconds'] * 1e3:.0f} ms (connect {h['connect'] * 1e3:.0f}, build "
                         f"{h['build'] * 1e3:.0f}, commit {h['commit'] * 1e3:.0f})")
    lines += summary(by_step, R)
    passed &= result["finished"] == list(range(R)) and len(by_step) >= cfg["steps"]
    return lines, passed


def summary(by_step: dict[int, list[dict]], ranks: int) -> list[str]:
    """The admission's cost to the survivors (their step time at each replacement's first joint step against
    the median step with every rank in, after two warm-up steps) and the joins' times."""
    joined = {rec["step"]: rec for recs in by_step.values() for rec in recs if "admitted" in rec}
    normal = [max(r["seconds"] for r in recs) for s, recs in by_step.items()
              if s >= 2 and s not in joined and len(recs) == ranks and not any(r["masked"] for r in recs)]
    if not normal:
        return []
    median = statistics.median(normal)
    lines = [f"normal step (every rank in, median of {len(normal)}): {median * 1e3:.2f} ms"]
    for step, rec in sorted(joined.items()):
        survivors = max(r["seconds"] for r in by_step[step] if r["rank"] != rec["rank"])
        lines.append(f"admission of rank {rec['rank']} at step {step}: the survivors' step {survivors * 1e3:.2f} ms = "
                     f"{survivors / median:.2f}x a normal step; its join: ready -> admitted "
                     f"{rec['admitted'] - rec['ready']:.2f} s after start -> ready {rec['ready'] - rec['started']:.2f} s")
    return lines


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=45,
                   help="decode steps at least; then on until every rank has been in for two steps (--max-steps at most)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="the most steps the loop runs (default: 3x --steps); replacements start one at a time, each "
                        "after a start-up of seconds, so a job that waits for several may need more")
    p.add_argument("--tokens", type=int, default=8, help="decode tokens per rank and step")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--timeout", type=float, default=10.0, help="the Buffer's deadline (timeout_s)")
    p.add_argument("--step-s", type=float, default=0.5, help="the loop's pace: a step starts at most this often")
    p.add_argument("--kill", default="2:8,1:24",
                   help="rank:step[:now|:invite] pairs: the rank kills itself (SIGKILL) there, or at the first step after "
                        "that with every rank back in; with ':now' there, whoever is masked; with ':invite' (step "
                        "ignored) as soon as the survivors invite another rank, during the admission")
    p.add_argument("--late", default="",
                   help="rank:step pairs: the job starts without the rank (MOE_COMM_MIN_RANKS: its slot is reserved), "
                        "which starts once the others reach the step")
    p.add_argument("--replace", default="2:12,1:28",
                   help="rank:step[:die] triples: a replacement starts once the survivors reach the step, and the "
                        "replacement (or late start) started before it took its first step or exited; with ':die' it "
                        "dies during its own join")
    p.add_argument("--transport", default="shm", help="MOE_COMM_TRANSPORT of every rank: shm or collective")
    p.add_argument("--ranks-per-node", type=int, default=0, help="MOE_COMM_RANKS_PER_NODE (emulated nodes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the configuration, records and events to this file")
    args = p.parse_args(argv)
    if args.max_steps and args.max_steps < args.steps:
        p.error(f"--max-steps must be at least --steps ({args.steps}), got {args.max_steps}")
    return args


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The job's configuration (what every process reads)."""
    def pairs(text: str) -> list[list[str]]:
        return [part.split(":") for part in text.split(",") if part]
    max_steps = args.max_steps or 3 * args.steps
    return {"ranks": args.ranks, "steps": args.steps, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
            "experts": args.experts, "topk": args.topk, "timeout": args.timeout, "seed": args.seed,
            "step_s": args.step_s, "max_steps": max_steps,
            "kill": {int(p[0]): (int(p[1]), p[2] if len(p) > 2 else "") for p in pairs(args.kill)},
            "late": [(int(r), int(s)) for r, s in pairs(args.late)],
            "replace": [(int(p[0]), int(p[1]), len(p) > 2 and p[2] == "die") for p in pairs(args.replace)],
            "job_timeout": 120 + max_steps * (args.step_s + 1) + 4 * args.timeout, "die_in_join": False}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        cfg = json.loads(os.environ["ELASTIC_DECODE_CFG"])
        cfg["kill"] = {int(k): tuple(v) for k, v in cfg["kill"].items()}
        cfg["die_in_join"] = os.environ.get("ELASTIC_DECODE_DIE_IN_JOIN") == "1"
        run_rank(cfg)
        return 0
    cfg = config(args)
    env = {"MOE_COMM_TRANSPORT": args.transport}
    if args.ranks_per_node:
        env["MOE_COMM_RANKS_PER_NODE"] = str(args.ranks_per_node)
    print(f"elastic decode: {cfg['ranks']} ranks, transport {args.transport}"
          + (f", nodes of {args.ranks_per_node} ranks" if args.ranks_per_node else "")
          + f", hidden {cfg['hidden']}, top-{cfg['topk']} of {cfg['experts']} experts, {cfg['tokens']} tokens per "
          f"rank, {cfg['steps']} steps; kills {args.kill}, replacements {args.replace}"
          + (f", late starts {args.late}" if args.late else ""), flush=True)
    result = launch(cfg, env)
    lines, passed = table(result, cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "passed": passed, **result}, f)
    print("\n".join(lines))
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
