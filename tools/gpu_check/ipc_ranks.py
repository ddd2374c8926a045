"""R processes on one GPU as R real ranks: each allocates its buffers as a ``moe_comm._cuda.SharedBuffer``,
the handles go round through this process (multiprocessing queues: an all-gather), every rank maps its
peers' buffers over CUDA IPC and runs its own launches of ``_cuda.Normal`` (notify, dispatch, prologue,
combine; bf16 and FP8), ``_cuda.Internode`` (the same across 2 nodes of R / 2 ranks) and
``_cuda.LowLatency`` (dispatch and combine, send and receive halves; bf16, FP8, FP8 with UE8M0 scales).
With ``--link nvshmem`` the ranks form an NVSHMEM world (one PE each, on the one GPU: NVSHMEM's limited
mode, where point-to-point puts and signals work) and the internode RDMA and low-latency buffers are its
symmetric memory, launched through ``moe_comm._cuda_nvshmem`` (peers on one GPU are NVLink-mapped: its
puts are stores). Every rank's outputs come back here and must equal, byte for byte, those of
``moe_comm._cuda_host`` run as R threads on CPU copies of the same inputs.

Without MPS the ranks' contexts share the GPU by time slicing: a kernel waiting on a peer's kernel
progresses when the peer's context gets its slice (ms), so the shapes are small and the kernels'
waits have a deadline (--timeout): a rank that cannot progress reports a TIMEOUT record instead of
hanging the step.

    python tools/gpu_check/ipc_ranks.py --ranks 2 4 --json OUT.json
    python tools/gpu_check/ipc_ranks.py --ranks 2 4 --link nvshmem --cases internode_bf16 ll_bf16
    python tools/gpu_check/ipc_ranks.py --ranks 2 --host-only   # the same processes on _cuda_host over
                                                                # /dev/shm: the harness, without a GPU
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback

import common  # noqa: F401  (import path)
from emulated import CASES, shapes

GATHER_WAIT_S = 60.0  # a rank waits this long for its peers at an all-gather, then gives up


def case_of(case: str, s):
    """The harness's case class and inputs of an emulated.py case name."""
    from harness import InternodeCase, LowLatencyCase, NormalCase, internode_inputs, low_latency_inputs, normal_inputs
    if case.startswith("internode"):
        return InternodeCase, internode_inputs(s)
    if case.startswith("normal"):
        return NormalCase, normal_inputs(s)
    return LowLatencyCase, low_latency_inputs(s)


def child(rank: int, R: int, device: str, to_parent, from_parent, cases: list, timeout_s: float,
          shm_prefix: str, link: str) -> None:
    """One rank: its buffers, its launches, its outputs (packed) back to the parent."""
    try:
        import torch
        from harness import ProcessSide, pack
        if device == "cuda":
            torch.cuda.set_device(0)
        torch.set_num_threads(1)

        def allgather(tag: str, obj):
            to_parent.put(("gather", rank, tag, obj))
            kind, got_tag, objs = from_parent.get(timeout=GATHER_WAIT_S)
            if got_tag != tag:
                raise RuntimeError(f"rank {rank}: all-gather {tag!r} answered as {got_tag!r}")
            return objs

        side = ProcessSide(rank, R, allgather, device, timeout_s, shm_prefix, link)
        results = {}
        for case in cases:
            s = shapes(case, R, small=False)
            t0 = time.perf_counter()
            try:
                Case, ins = case_of(case, s)
                outs = Case(side, s, ins).run()
                results[case] = {"ok": True, "outputs": pack(outs), "seconds": time.perf_counter() - t0}
            except Exception as exc:  # noqa: BLE001 - recorded; the next case still runs on every rank
                results[case] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                 "seconds": time.perf_counter() - t0}
        side.close()
        to_parent.put(("done", rank, results))
    except BaseException as exc:  # noqa: BLE001 - the parent records it
        to_parent.put(("crash", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2500:]}"))


def run_processes(R: int, device: str, cases: list, timeout_s: float, deadline_s: float, link: str = "ipc") -> dict:
    """Spawns R ranks, serves their all-gathers, returns {rank: results or crash}."""
    ctx = mp.get_context("spawn")
    to_parent = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(R)]
    prefix = f"/dev/shm/moe_comm_gpu_check_{os.getpid()}_{R}"
    procs = [ctx.Process(target=child, args=(r, R, device, to_parent, inboxes[r], cases, timeout_s, prefix, link),
                         daemon=True) for r in range(R)]
    for p in procs:
        p.start()
    pending: dict[str, dict] = {}
    done: dict[int, dict] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(done) < R:
            left = end - time.monotonic()
            if left <= 0:
                for r in range(R):
                    done.setdefault(r, {"crash": f"no answer within the {deadline_s:.0f} s deadline"})
                break
            try:
                msg = to_parent.get(timeout=min(left, 1.0))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and not p.is_alive() and to_parent.empty():
                        done[r] = {"crash": f"process exited with code {p.exitcode} before answering"}
                continue
            if msg[0] == "gather":
                _, rank, tag, obj = msg
                pending.setdefault(tag, {})[rank] = obj
                if len(pending[tag]) == R:
                    everyone = [pending[tag][r] for r in range(R)]
                    for box in inboxes:
                        box.put(("gathered", tag, everyone))
                    del pending[tag]
            elif msg[0] == "done":
                done[msg[1]] = msg[2]
            else:
                done[msg[1]] = {"crash": msg[2]}
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
            if name.startswith(os.path.basename(prefix)):
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
    return done


def check_ranks(R: int, device: str, cases: list, timeout_s: float, deadline_s: float, link: str = "ipc") -> dict:
    from harness import HostSide, compare, unpack
    refs = {}
    for case in cases:
        s = shapes(case, R, small=False)
        Case, ins = case_of(case, s)
        refs[case] = Case(HostSide(R, timeout_s), s, ins).run()
    t0 = time.perf_counter()
    done = run_processes(R, device, cases, timeout_s, deadline_s, link)
    out: dict = {"processes_seconds": round(time.perf_counter() - t0, 3), "cases": {}}
    crashes = {r: d["crash"] for r, d in done.items() if "crash" in d}
    if crashes:
        out["crashes"] = crashes
    for case in cases:
        per = {}
        for r in range(R):
            res = done.get(r, {}).get(case) if r not in crashes else None
            if res is None:
                per[r] = {"ok": False, "error": "no result (the rank crashed or timed out)"}
            elif not res["ok"]:
                per[r] = {"ok": False, "error": res["error"]}
            else:
                bad = compare({r: refs[case][r]}, unpack(res["outputs"]))
                per[r] = {"ok": not bad, "mismatches": bad[:10], "seconds": round(res["seconds"], 3)}
        out["cases"][case] = {"ok": all(p["ok"] for p in per.values()), "ranks": per}
    out["ok"] = not crashes and all(c["ok"] for c in out["cases"].values())
    over = "_cuda_host over /dev/shm" if device != "cuda" else \
        "_cuda over CUDA IPC" if link == "ipc" else "_cuda (IPC) and _cuda_nvshmem (NVSHMEM)"
    out["compared"] = f"{R} processes of {over} vs _cuda_host threads, bitwise"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="process counts to run, each in turn")
    ap.add_argument("--host-only", action="store_true",
                    help="the processes run moe_comm._cuda_host on /dev/shm buffers (no GPU needed)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--link", choices=("ipc", "nvshmem"), default="ipc",
                    help="how the internode RDMA and low-latency buffers are reached (nvshmem: on the GPU only)")
    ap.add_argument("--timeout", type=float, default=10.0, help="kernel wait deadline, seconds")
    ap.add_argument("--deadline", type=float, default=40.0, help="per process count: kill the ranks after this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device = "cpu" if a.host_only else "cuda"
    rec = common.Record(a.json, tool="ipc_ranks", ranks=a.ranks, device=device, link=a.link)
    if a.link == "nvshmem" and device != "cuda":
        rec.check("link", lambda: {"ok": False, "error": "--link nvshmem needs the GPU (not --host-only)"})
        return rec.finish()
    if device == "cuda" and not common.gpu_present():
        rec.check("gpu", lambda: {"ok": False, "error": "no CUDA device (torch.cuda.is_available() is False)"})
        return rec.finish()
    for R in a.ranks:
        rec.check(f"R{R}", lambda R=R: check_ranks(R, device, a.cases, a.timeout, a.deadline, a.link))
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
