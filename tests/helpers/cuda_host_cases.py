"""The same calls on two backends (test_cuda_host.py: portable and cuda_host on the CPU;
test_cuda_backend.py: portable and cuda, on a GPU or on the host build's kernels)."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

import moe_comm


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8) if t.dtype.itemsize == 1 or t.dtype in (torch.bfloat16, torch.float16) else t


def calls(group: dist.ProcessGroup, backend: str, device: str, seed: int, config: dict[str, int],
          comm_stream: Optional[type] = None) -> list[Any]:
    """Every normal-mode and low-latency call with its optional inputs (async events, previous events,
    FP8, cached, num_worst_tokens, biases, hooks, zero-copy, stats) on one backend and device; every
    output on the CPU. The inputs are drawn on the CPU, the same for every backend."""
    from moe_comm.ops import per_token_cast_to_fp8
    R, me = group.size(), group.rank()
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed * 100 + me)
    T, H, E, K, M = 29 + 3 * me, 512, 4 * R, min(3, 4 * R), 32
    buf = moe_comm.Buffer(group, backend=backend, low_latency_mode=True, explicitly_destroy=True, timeout_s=240,
                          num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E))
    cfg = moe_comm.Config(**config)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    topk[::5, -1] = -1
    w = torch.rand(T, K, generator=g)
    bias = torch.randn(T, H, generator=g).to(torch.bfloat16)
    expert_outs = [torch.randn(E // R, R * M, H, generator=g).to(torch.bfloat16) for _ in range(6)]
    q, s = per_token_cast_to_fp8(x)
    x, topk, w, bias, q, s = (t.to(dev) for t in (x, topk, w, bias, q, s))
    out: list[Any] = []

    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    out += [n_rank, n_expert, in_rank]
    rx, rtopk, rw, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert, topk_idx=topk,
        topk_weights=w, config=cfg, expert_alignment=4, previous_event=buf.capture(), async_finish=True)
    event.current_stream_wait()
    out += [rx, rtopk, rw, counts, *handle]
    y, yw, event = buf.combine(rx, handle, topk_weights=rw, bias=(bias, bias * 2), config=cfg, async_finish=True)
    event.current_stream_wait()
    out += [y, yw]
    (cx, cs), *_ = buf.dispatch((q, s), handle=handle, config=cfg)
    out += [cx, cs]
    worst = buf.dispatch(x.float(), topk_idx=topk, topk_weights=w, num_experts=E, config=cfg, num_worst_tokens=T * R)
    out += [worst[0], worst[1], worst[2], *worst[4]]
    y2, _, _ = buf.combine(worst[0][:, :8].contiguous(), worst[4], config=cfg)  # padded rows are ignored
    out += [y2]

    stats = torch.zeros(E // R, dtype=torch.int32, device=dev)
    formats = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    for i, (use_fp8, round_scale, ue8m0) in enumerate(formats):
        rx_ll, cnt, h_ll, _, hook = buf.low_latency_dispatch(x[:M], topk[:M], M, E, use_fp8=use_fp8,
                                                             round_scale=round_scale, use_ue8m0=ue8m0,
                                                             cumulative_local_expert_recv_stats=stats,
                                                             return_recv_hook=True)
        hook()
        out += [*(rx_ll if use_fp8 else (rx_ll,)), cnt, h_ll[0], h_ll[1]]
        y_ll, event, _ = buf.low_latency_combine(expert_outs[i].to(dev), topk[:M], w[:M], h_ll, async_finish=True)
        event.current_stream_wait()
        out += [y_ll]
    out += [stats]
    rx_ll, _, h_ll, _, _ = buf.low_latency_dispatch(x[:M], topk[:M], M, E, use_fp8=False)
    lent = buf.get_next_low_latency_combine_buffer(h_ll)
    lent.copy_(expert_outs[4].to(dev))
    y_zc, _, hook = buf.low_latency_combine(lent, topk[:M], w[:M], h_ll, zero_copy=True, return_recv_hook=True)
    hook()
    out += [rx_ll, y_zc]
    buf.clean_low_latency_buffer(M, H, E)
    rx_ll, _, h_ll, _, _ = buf.low_latency_dispatch(x[:M], topk[:M], M, E, use_fp8=False)
    y_ll, _, _ = buf.low_latency_combine(expert_outs[5].to(dev), topk[:M], w[:M], h_ll)
    out += [rx_ll, y_ll]
    if comm_stream is not None:
        assert isinstance(buf.get_comm_stream(), comm_stream), buf.get_comm_stream()
    buf.destroy()
    return [_bits(t) if isinstance(t, torch.Tensor) else t for t in out]


def both_backends(group: dist.ProcessGroup, seed: int, config: dict[str, int],
                  ranks_per_node: Optional[int] = None) -> list[bool]:
    """Per output of ``calls``: equal (bitwise) on the portable and the cuda_host backends; with
    ``ranks_per_node`` the group is split into nodes of that many ranks (``MOE_COMM_RANKS_PER_NODE``), so
    normal mode takes DeepEP's internode forms and the cuda_host kernels' two hops."""
    if ranks_per_node is not None:
        os.environ["MOE_COMM_RANKS_PER_NODE"] = str(ranks_per_node)
    try:
        a, b = calls(group, "portable", "cpu", seed, config), calls(group, "cuda_host", "cpu", seed, config)
    finally:
        os.environ.pop("MOE_COMM_RANKS_PER_NODE", None)
    assert len(a) == len(b) > 50
    return [torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b)]


def tampered_internode_handle(group: dist.ProcessGroup) -> tuple[str, str, bool]:
    """cuda_host across 2 nodes (MOE_COMM_RANKS_PER_NODE=2): rank 0 changes its handle's forwarded-token prefix
    in place before a combine (the forwarders index by it): its ValueError, the others'
    CrossRankMismatchError; with the field restored the next combine is the portable sum."""
    os.environ["MOE_COMM_RANKS_PER_NODE"] = "2"
    try:
        buf = moe_comm.Buffer(group, backend="cuda_host", explicitly_destroy=True, timeout_s=60)
    finally:
        os.environ.pop("MOE_COMM_RANKS_PER_NODE", None)
    g = torch.Generator().manual_seed(group.rank())
    T, H, E = 17, 256, 2 * group.size()
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)])
    recv, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=torch.ones(T, 3), num_experts=E)
    prefix = handle[3]
    saved = prefix.clone()
    if group.rank() == 0:
        prefix[0, -1] += 5
    try:
        buf.combine(recv, handle)
        kind, message = "none", ""
    except Exception as exc:  # the test asserts on the type and the words
        kind, message = type(exc).__name__, str(exc)
    prefix.copy_(saved)
    out, _, _ = buf.combine(recv, handle)
    ok = bool(torch.isfinite(out.float()).all())
    buf.destroy()
    return kind, message, ok
