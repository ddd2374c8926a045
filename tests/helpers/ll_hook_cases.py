"""Low-latency hooks, async results and double buffering, run inside ranks."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from helpers.low_latency_cases import ll_buffer, routing

T, H, K, E = 12, 256, 3, 8


def _inputs(rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed * 100 + rank)
    x = torch.randn(T, H).to(torch.bfloat16)
    topk_idx, topk_weights = routing(T, E * dist.get_world_size(), K, seed * 100 + rank)
    return x, topk_idx, topk_weights


def _bits(t: Any) -> list:
    parts = list(t) if isinstance(t, tuple) else [t]
    return [p.contiguous().view(torch.uint8).clone() for p in parts]


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # the test checks type and message
        return f"{type(exc).__name__}: {exc}"
    return "no exception"


def hooks_and_buffers(group: dist.ProcessGroup) -> dict[str, Any]:
    """Hooked and async results equal synchronous ones; the double-buffer rules hold."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    experts = E * R
    buf = ll_buffer(group, T, H, experts)
    out: dict[str, Any] = {}
    a, b = _inputs(rank, 1), _inputs(rank, 2)
    ref = {}
    for name, (x, idx, _) in (("a", a), ("b", b)):
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, experts)
        ref[name] = (_bits(recv_x), count.clone(), handle[1].clone())

    # Two hooked dispatches in flight, received in reverse order, with compute in between.
    ra = buf.low_latency_dispatch(a[0], a[1], T, experts, return_recv_hook=True)
    rb = buf.low_latency_dispatch(b[0], b[1], T, experts, return_recv_hook=True)
    out["event_empty_with_hook"] = ra[3].event is None and ra[4] is not None
    torch.randn(256, 256) @ torch.randn(256, 256)  # compute while the payload moves
    out["third_call_refused"] = _raises(lambda: buf.low_latency_dispatch(a[0], a[1], T, experts))
    out["clean_refused"] = _raises(lambda: buf.clean_low_latency_buffer(T, H, experts))
    rb[4]()
    ra[4]()
    out["hooked_equal_sync"] = all(
        all(torch.equal(p, q) for p, q in zip(_bits(r[0]), ref[n][0])) and torch.equal(r[1], ref[n][1])
        and torch.equal(r[2][1], ref[n][2]) for r, n in ((ra, "a"), (rb, "b")))
    out["hook_twice"] = _raises(ra[4])

    # Async results: a third call on the buffer of an un-waited async result completes it first.
    aa = buf.low_latency_dispatch(a[0], a[1], T, experts, async_finish=True)
    ab = buf.low_latency_dispatch(b[0], b[1], T, experts, async_finish=True)
    buf.low_latency_dispatch(b[0], b[1], T, experts)  # reuses aa's buffer
    out["async_completed_by_reuse"] = all(torch.equal(p, q) for p, q in zip(_bits(aa[0]), ref["a"][0]))
    ab[3].current_stream_wait()
    aa[3].current_stream_wait()  # already complete: a no-op
    out["async_equal_sync"] = all(torch.equal(p, q) for p, q in zip(_bits(ab[0]), ref["b"][0]))

    # Combine with a hook; zero copy needs the buffer lent right before.
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(a[0], a[1], T, experts, use_fp8=False)
    want, _, _ = buf.low_latency_combine(recv_x, a[1], a[2], handle)
    got, event, hook = buf.low_latency_combine(recv_x, a[1], a[2], handle, return_recv_hook=True)
    hook()
    out["combine_hook_equal"] = torch.equal(got.view(torch.int16), want.view(torch.int16))
    buf.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
    buf.low_latency_dispatch(a[0], a[1], T, experts)  # another call in between: the lent buffer is stale
    out["zero_copy_stale"] = _raises(lambda: buf.low_latency_combine(recv_x, a[1], a[2], handle, zero_copy=True))
    buf.get_next_low_latency_combine_buffer(handle).copy_(recv_x)
    got, _, _ = buf.low_latency_combine(torch.zeros_like(recv_x), a[1], a[2], handle, zero_copy=True)
    out["zero_copy_reads_buffer"] = torch.equal(got.view(torch.int16), want.view(torch.int16))

    # Stats accumulate across calls.
    stats = torch.zeros(E, dtype=torch.int32)
    for _ in range(2):
        _, count, _, _, _ = buf.low_latency_dispatch(a[0], a[1], T, experts, cumulative_local_expert_recv_stats=stats)
    out["stats_accumulate"] = torch.equal(stats, 2 * count)
    buf.clean_low_latency_buffer(T, H, experts)
    buf.destroy()
    return out


def hook_does_not_wait_for_peers_hooks(group: dist.ProcessGroup, delay_s: float) -> float:
    """The last rank delays its hook; the others' hooks must not wait for it (the sends are done)."""
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    buf = ll_buffer(group, T, H, E * R)
    x, idx, _ = _inputs(rank, 3)
    _, _, _, _, hook = buf.low_latency_dispatch(x, idx, T, E * R, return_recv_hook=True)
    if rank == R - 1:
        time.sleep(delay_s)
    start = time.monotonic()
    hook()
    elapsed = time.monotonic() - start
    dist.barrier(group)
    buf.destroy()
    return elapsed
