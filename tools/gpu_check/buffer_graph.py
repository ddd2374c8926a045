"""Buffer-level CUDA-graph capture of a low-latency decode step: R processes on the one GPU (a gloo group
for the constructor; the cuda backend's buffers over CUDA IPC) each run

    Buffer.low_latency_dispatch(..., use_fp8=True, return_recv_hook=True) -> hook()
    Buffer.low_latency_combine(..., return_recv_hook=True) -> hook()

eagerly on three input sets (the references), then capture that step in one CUDA graph
(``torch.cuda.graph``) and replay it ``--replays`` times, each replay after copying one of the input sets
into the captured tensors: every replay's outputs (received FP8 codes and scales, counts, combined
rows) must equal the eager ones bitwise. The call numbers advance on the device (the kernels count
them in the buffer), so replays and eager calls mix: an eager step after the replays must still equal
its reference. Then rank R - 1 runs the step with another hidden size, eagerly (every rank must raise
CrossRankMismatchError at its hook), then captured: every rank replays its graph once, and the next
eager step must raise CrossRankMismatchError on every rank; the step after it must equal its
reference again.

``--compiled N`` runs, instead of the capture and the mismatch, the same step under
``torch.compile(step, mode="reduce-overhead", fullgraph=True)`` (Inductor's CUDA graphs over the
``torch.ops.moe_comm`` ops) N times on the input sets in turn, each call's outputs against the eager
ones bitwise, then an eager step after them.

``--backend cuda_host`` runs the eager half (references twice, the mismatched eager step, the recovery)
and the compiled calls (compiled without CUDA graphs: the tensors are on the CPU) on the host build: the
harness without a GPU. The graph half needs the GPU: with ``--backend cuda`` and no GPU the record
fails, saying so.

    python tools/gpu_check/buffer_graph.py --ranks 2 --replays 100 --json OUT.json
    python tools/gpu_check/buffer_graph.py --ranks 2 --compiled 20 --json OUT.json
    python tools/gpu_check/buffer_graph.py --ranks 2 --backend cuda_host
"""
from __future__ import annotations

import argparse
import sys

from common import Record  # (and the import path)

T, H, K, SETS = 16, 1024, 4, 3  # tokens per rank, hidden, top-k, input sets


def _inputs(rank: int, R: int, seed: int, hidden: int, device: str) -> list:
    """x [T, hidden] bf16, top-k ids [T, K], weights [T, K] fp32 and the combine's rows [E_loc, R * T,
    hidden] bf16, drawn on the CPU from (seed, rank), then moved to ``device``."""
    import torch
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    E = 4 * R
    x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen)
    y = torch.randn(E // R, R * T, hidden, generator=gen).to(torch.bfloat16)
    return [t.to(device) for t in (x, idx, w, y)]


def _same(a: list, b: list) -> bool:
    """Whether the tensors of ``a`` and ``b`` are equal byte for byte."""
    import torch
    bits = lambda t: t.contiguous().flatten().view(torch.uint8).cpu()  # noqa: E731
    return len(a) == len(b) and all(torch.equal(bits(u), bits(v)) for u, v in zip(a, b))


def rank_main(group, backend: str, replays: int, timeout_s: float, compiled: int = 0) -> dict:
    """One rank: its references, then graph replays and the mismatch, or ``compiled`` compiled calls;
    returns what it saw."""
    import torch

    import moe_comm
    from moe_comm.core.errors import CrossRankMismatchError
    device = "cuda" if backend == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    rank, R = group.rank(), group.size()
    E = 4 * R
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = moe_comm.Buffer(group, backend=backend, num_rdma_bytes=hint, low_latency_mode=True,
                          num_qps_per_rank=E // R, explicitly_destroy=True, timeout_s=timeout_s)

    def step(x, idx, w, y) -> list:
        (codes, scales), count, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True,
                                                                          return_recv_hook=True)
        hook()
        out, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        hook()
        return [codes, scales, count, out]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    sets = [_inputs(rank, R, k, H, device) for k in range(SETS)]
    refs = [[t.clone() for t in step(*s)] for s in sets]
    sync()
    seen: dict = {"rank": rank, "eager_repeats_equal": all(_same(step(*s), r) for s, r in zip(sets, refs))}
    if compiled:
        fast = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        bad = []
        for i in range(compiled):
            outs = fast(*sets[i % SETS])
            sync()
            if not _same(outs, refs[i % SETS]):
                bad.append(i)
        seen["compiled"], seen["compiled_unequal"] = compiled, bad[:10]
        seen["recovered_equal"] = _same(step(*sets[2]), refs[2])  # an eager step after the compiled ones
        sync()
        buf.destroy()
        return seen
    if device == "cuda":
        static = [t.clone() for t in sets[0]]
        graph = torch.cuda.CUDAGraph()
        sync()
        with torch.cuda.graph(graph):
            outs = step(*static)
        bad = []
        for i in range(replays):
            k = i % SETS
            for t, v in zip(static, sets[k]):
                t.copy_(v)
            graph.replay()
            sync()
            if not _same(outs, refs[k]):
                bad.append(i)
        seen["replays"], seen["replays_unequal"] = replays, bad[:10]
        seen["eager_after_replays_equal"] = _same(step(*sets[1]), refs[1])
    def raised(inputs: list) -> str:
        try:
            step(*inputs)
            return "no error"
        except CrossRankMismatchError as exc:
            return f"CrossRankMismatchError: {exc}"
        except Exception as exc:  # recorded: the check fails on it
            return f"{type(exc).__name__}: {exc}"

    # another hidden size on the last rank: eagerly (every rank raises at the hook; this also builds the
    # launch objects of that shape, which a capture cannot allocate), then captured and replayed (GPU)
    odd = _inputs(rank, R, 7, H // 2 if rank == R - 1 else H, device)
    seen["mismatch"] = raised(odd)
    if device == "cuda":
        graph2 = torch.cuda.CUDAGraph()
        sync()
        with torch.cuda.graph(graph2):
            step(*[t.clone() for t in odd])
        graph2.replay()
        sync()
        seen["replayed_mismatch"] = raised(sets[0])  # the next eager step raises the replay's verdict
    seen["recovered_equal"] = _same(step(*sets[2]), refs[2])
    sync()
    buf.destroy()
    return seen


def check(R: int, backend: str, replays: int, timeout_s: float, compiled: int = 0) -> dict:
    from moe_comm.launch import LocalWorld
    if backend == "cuda":
        import torch
        if not torch.cuda.is_available():
            return {"ok": False, "error": "the graph half needs the GPU (torch.cuda.is_available() is False)"}
    with LocalWorld(R, backend="gloo", timeout_s=timeout_s * 4, threads_per_rank=1) as world:
        ranks = world.run(rank_main, backend, replays, timeout_s, compiled)
    if compiled:
        ok = all(r["eager_repeats_equal"] and r["recovered_equal"] and not r["compiled_unequal"] for r in ranks)
        return {"ok": ok, "ranks": ranks}
    ok = all(r["eager_repeats_equal"] and r["recovered_equal"] and r["mismatch"].startswith("CrossRankMismatchError")
             and r.get("replayed_mismatch", "CrossRankMismatchError").startswith("CrossRankMismatchError")
             and not r.get("replays_unequal") and r.get("eager_after_replays_equal", True) for r in ranks)
    return {"ok": ok, "ranks": ranks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--replays", type=int, default=100)
    ap.add_argument("--backend", choices=("cuda", "cuda_host"), default="cuda")
    ap.add_argument("--timeout", type=float, default=10.0, help="each Buffer's deadline (s)")
    ap.add_argument("--compiled", type=int, default=0,
                    help="instead of the capture: this many calls of the step under torch.compile(mode='reduce-overhead')")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rec = Record(args.json, backend=args.backend, replays=args.replays, compiled=args.compiled)
    for R in args.ranks:
        rec.check(f"R{R}", lambda R=R: check(R, args.backend, args.replays, args.timeout, args.compiled))
    return rec.finish()


if __name__ == "__main__":
    sys.exit(main())
