"""Rank functions for test_shm: transports compared bit for bit, growth, spill, faults, masks, hosts."""
from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.ops import per_token_cast_to_fp8
from moe_comm.transport.shm_segment import DATA, PREFIX, create_held

from helpers.processes import all_gone


def _digest(*tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(t, (tuple, list)):
            h.update(_digest(*t).encode())
        else:
            h.update(repr(t).encode())
    return h.hexdigest()


def _inputs(rank: int, tokens: int, hidden: int, experts: int, topk: int, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.empty(0, topk, dtype=torch.int64)
    if tokens:
        idx[torch.rand(tokens, topk, generator=g) < 0.1] = -1
    return x, idx, torch.rand(tokens, topk, generator=g)


def normal_digests(buf: moe_comm.Buffer, tokens: int = 40, hidden: int = 256, experts: int = 12,
                   topk: int = 3) -> list[str]:
    """Digests of every output of BF16/FP8 dispatch, cached dispatch and combine (plain, weighted, biased)."""
    x, idx, w = _inputs(buf.rank, tokens + 7 * buf.rank, hidden, experts, topk)
    out = []
    rx, ri, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts)
    out.append(_digest(rx, ri, rw, counts, handle))
    q = per_token_cast_to_fp8(x)
    fx, *_ = buf.dispatch(q, handle=handle)
    out.append(_digest(fx))
    y, _, _ = buf.combine(rx, handle)
    bias = torch.ones_like(x)
    yb, _, _ = buf.combine(rx, handle, bias=(bias, bias))
    yw, ww, _ = buf.combine(rx, handle, topk_weights=rw)
    out.append(_digest(y, yb, yw, ww))
    return out


def low_latency_digests(buf: moe_comm.Buffer, tokens: int, hidden: int, experts: int, topk: int = 3) -> list[str]:
    """Digests of low-latency BF16 and FP8 dispatch and combine."""
    x, idx, w = _inputs(buf.rank, tokens - buf.rank, hidden, experts, topk, seed=1)
    out = []
    for use_fp8 in (False, True):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, tokens, experts, use_fp8=use_fp8)
        out.append(_digest(recv, count, handle))
        data = recv if not use_fp8 else recv[0].float().bfloat16()
        y, _, _ = buf.low_latency_combine(data, idx, w, handle)
        out.append(_digest(y))
    return out


def both_transports(group: dist.ProcessGroup) -> dict[str, list[str]]:
    """The same calls on a collective buffer and on a shm buffer."""
    M, H, E = 24, 512, 12
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, dist.get_world_size(group), E)
    result = {}
    for name in ("collective", "shm"):
        buf = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, transport=name, timeout_s=30,
                              explicitly_destroy=True)
        result[name] = normal_digests(buf) + low_latency_digests(buf, M, H, E)
        buf.destroy()
    return result


def growth(group: dist.ProcessGroup) -> dict[str, Any]:
    """A shm buffer made small grows to fit an exchange and gives the collective transport's bits."""
    small = moe_comm.Buffer(group, transport="shm", timeout_s=30, explicitly_destroy=True)
    before = small.runtime.transport.capacity
    digests = normal_digests(small, tokens=300, hidden=2048)  # ~2.4 MiB per rank, > 1 MiB
    after = small.runtime.transport.capacity
    small.destroy()
    sized = moe_comm.Buffer(group, num_nvl_bytes=8 << 20, transport="shm", timeout_s=30, explicitly_destroy=True)
    sized_capacity = sized.runtime.transport.capacity
    sized.destroy()
    # DeepEP's hints reach GBs; the segment is created at the cap and grows only when needed
    huge = moe_comm.Buffer(group, num_rdma_bytes=8 << 30, transport="shm", timeout_s=30, explicitly_destroy=True)
    huge_capacity = huge.runtime.transport.capacity
    huge.destroy()
    ref = moe_comm.Buffer(group, transport="collective", timeout_s=30, explicitly_destroy=True)
    want = normal_digests(ref, tokens=300, hidden=2048)
    ref.destroy()
    return dict(before=before, after=after, same=digests == want, sized=sized_capacity, huge=huge_capacity)


def many_in_flight(group: dist.ProcessGroup, count: int) -> bool:
    """``count`` async dispatches in flight at once (more than the two slots: the oldest spill)
    equal the same dispatches run one by one."""
    buf = moe_comm.Buffer(group, timeout_s=30)
    inputs = [_inputs(buf.rank, 30, 128, 12, 2, seed=s) for s in range(count)]
    pending = [buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=12, async_finish=True) for x, i, w in inputs]
    for p in reversed(pending):
        p[-1].current_stream_wait()
    got = [_digest(p[0], p[1], p[2]) for p in pending]
    want = [_digest(*buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=12)[:3]) for x, i, w in inputs]
    return got == want


def grow_with_many_in_flight(group: dist.ProcessGroup, delay_rank: int) -> bool:
    """Async dispatches in flight across a growth of the slots. ``delay_rank`` is slowed down right
    before it settles its own oldest exchange (fault injection around the real method), so its peer
    reaches the reused slot first: the grown slots must make the peer wait for the release."""
    buf = moe_comm.Buffer(group, timeout_s=30)
    if buf.rank == delay_rank:
        settle = buf.runtime.transport._next

        def slow_next(channel: int) -> tuple[int, int]:
            if channel == DATA:
                time.sleep(0.1)
            return settle(channel)

        buf.runtime.transport._next = slow_next
    # Rows of 8 KB: the first dispatches fit the 1 MiB slots, the fourth grows them, and the ones
    # after it reuse the grown slots while older exchanges are still unread.
    inputs = [_inputs(buf.rank, min(40 * (1 + s), 160), 4096, 12, 3, seed=s) for s in range(8)]
    pending = [buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=12, async_finish=True) for x, i, w in inputs]
    for p in pending:
        p[-1].current_stream_wait()
    got = [_digest(p[0], p[1], p[2]) for p in pending]
    want = [_digest(*buf.dispatch(x, topk_idx=i, topk_weights=w, num_experts=12)[:3]) for x, i, w in inputs]
    return got == want and buf.runtime.transport.capacity > 1 << 20


def own_segments() -> list[str]:
    """moe-comm segments in /dev/shm created by this process."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{PREFIX}{os.getpid()}_")]


def segments_after_setup(group: dist.ProcessGroup) -> list[str]:
    buf = moe_comm.Buffer(group, transport="shm", timeout_s=30)
    normal_digests(buf)
    return own_segments()


def killed_mid_run(group: dist.ProcessGroup, victim: int, stamp_dir: str) -> tuple[str, str, float]:
    """Ranks dispatch in a loop; ``victim`` is SIGKILLed in the middle. Survivors return
    (exception, message, seconds from the kill to the error)."""
    buf = moe_comm.Buffer(group, transport="shm", timeout_s=120)
    x, idx, w = _inputs(buf.rank, 64, 1024, 12, 3)
    try:
        for step in range(1000):
            if buf.rank == victim and step == 5:
                with open(os.path.join(stamp_dir, "killed"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            rx, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=12)
            buf.combine(rx, handle)
    except Exception as exc:  # the test checks which
        noticed = time.time()
        with open(os.path.join(stamp_dir, "killed")) as f:
            killed = float(f.read())
        return type(exc).__name__, str(exc), noticed - killed
    return "no exception", "", 0.0


def plant_stale_segment(group: dist.ProcessGroup, dead_pid: int) -> tuple[bool, bool]:
    """Segments named for a dead process: one nobody holds (its creator died) disappears when a shm
    buffer is made, even a fresh one; one that a live process holds stays, even an old one (its
    creator may run in another pid namespace, whose pids mean nothing here). Returns (unheld exists,
    held exists) afterwards."""
    unheld, held = (f"{PREFIX}{dead_pid}_{kind}{dist.get_rank(group)}" for kind in ("unheld", "held"))
    with open(f"/dev/shm/{unheld}", "wb") as f:
        f.write(b"\0" * 4096)
    fd = create_held("/dev/shm", held, 4096)
    an_hour_ago = time.time() - 3600
    os.utime(f"/dev/shm/{held}", (an_hour_ago, an_hour_ago))
    try:
        moe_comm.Buffer(group, transport="shm", timeout_s=30)
        return os.path.exists(f"/dev/shm/{unheld}"), os.path.exists(f"/dev/shm/{held}")
    finally:
        os.unlink(f"/dev/shm/{held}")
        os.close(fd)


def masked_rank_survives(group: dist.ProcessGroup, victim: int, how: str) -> dict[str, Any]:
    """Low-latency calls go on without ``victim``: it exits (``how="exit"``, found automatically) or is
    masked by hand (``how="mask"``, it stays idle). Survivors check against a dense reference of the
    experts still alive."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    M, H, E, K = 16, 256, 4 * R, 3
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    buf = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True, timeout_s=30)
    pids: list[Any] = [None] * R
    dist.all_gather_object(pids, os.getpid(), group=group)
    low_latency_digests(buf, M, H, E)  # everybody alive
    if rank == victim:
        if how == "exit":
            os._exit(0)
        return {}
    if how == "mask":
        buf.low_latency_update_mask_buffer(victim, True)
    else:  # the next call finds it exited as it starts (a process slow to die beside a loaded machine is not)
        assert all_gone([pids[victim]]), f"rank {victim} (pid {pids[victim]}) still runs after os._exit"
    x, idx, w = _inputs(rank, M, H, E, K, seed=7)
    alive = (idx >= 0) & (idx // (E // R) != victim)
    results = {}
    for use_fp8 in (False, True):
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8)
        data = recv if not use_fp8 else (recv[0].float() * recv[1].repeat_interleave(128, dim=-1)).bfloat16()
        y, _, _ = buf.low_latency_combine(data, idx, w, handle)
        ref = x.float() * (w * alive).sum(1, keepdim=True)
        diff = 1 - 2 * (y.double() * ref.double()).sum() / ((y.double() ** 2).sum() + (ref.double() ** 2).sum())
        results["fp8" if use_fp8 else "bf16"] = float(diff)
    status = torch.zeros(R, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    results["mask"] = status.tolist()
    buf.low_latency_clean_mask_buffer()
    buf.low_latency_query_mask_buffer(status)
    results["after_clean"] = status.tolist()
    return results


def rejoin_after_mask(group: dist.ProcessGroup) -> tuple[str, str, list[int]]:
    """Rank 2 is masked while alive and sits out two low-latency calls, then everyone unmasks it and
    calls again: (exception type or "no exception", message, mask status afterwards). Rank 2 cannot
    rejoin; the others mask it again when it misses their deadline."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    M, H, E = 8, 128, 4 * R
    hint = moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    buf = moe_comm.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True, timeout_s=3,
                          transport="shm")
    x, idx, _ = _inputs(rank, M, H, E, 2)
    if rank != 2:
        buf.low_latency_update_mask_buffer(2, True)
        for _ in range(2):
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        buf.low_latency_update_mask_buffer(2, False)
    status = torch.zeros(R, dtype=torch.int32)
    try:
        buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    except Exception as exc:  # the test checks which
        return type(exc).__name__, str(exc), []
    buf.low_latency_query_mask_buffer(status)
    return "no exception", "", status.tolist()


def engine_local_world_size(group: dist.ProcessGroup, variable: str) -> dict[str, Any]:
    """With ``variable`` (LOCAL_WORLD_SIZE, or MOE_COMM_RANKS_PER_NODE) set to 1: a low-latency round trip at a
    real model's size (128 BF16 tokens x hidden 2048, top-2 of 8 experts, M 256, hooked) goes through, equal to
    the dense sum. vLLM's CPU platform sets LOCAL_WORLD_SIZE so (the tensor-parallel size): every rank of this
    host stays local to the shm transport. Nodes of one rank each move every row between ranks, a rank's rows
    to itself included, through the collective transport's posts."""
    os.environ[variable] = "1"
    try:
        R, m, hidden, experts = dist.get_world_size(group), 256, 2048, 8
        buf = moe_comm.Buffer(group, transport="shm", low_latency_mode=True, timeout_s=30,
                              num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(m, hidden, R, experts))
        g = torch.Generator().manual_seed(dist.get_rank(group))
        x = torch.randn(128, hidden, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(128)])
        w = torch.rand(128, 2, generator=g)
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False,
                                                              return_recv_hook=True)
        hook()
        combined = buf.low_latency_combine(recv_x, idx, w, handle)[0]
        want = (x.float() * w.sum(1, keepdim=True)).bfloat16()
        return dict(local=buf.runtime.transport.local, remote=buf.runtime.transport.remote,
                    internode=buf.topology.internode, equal=bool((combined.float() - want.float()).abs().max() <= 0.1))
    finally:
        del os.environ[variable]


def node_split(group: dist.ProcessGroup) -> dict[str, Any]:
    """With MOE_COMM_RANKS_PER_NODE=2 one host acts as two: shm inside each pair, collective between them;
    outputs equal the collective transport's."""
    os.environ["MOE_COMM_RANKS_PER_NODE"] = "2"
    try:
        result = both_transports(group)
        buf = moe_comm.Buffer(group, transport="shm", timeout_s=30)
        return dict(local=buf.runtime.transport.local, remote=buf.runtime.transport.remote,
                    same=result["shm"] == result["collective"])
    finally:
        del os.environ["MOE_COMM_RANKS_PER_NODE"]
