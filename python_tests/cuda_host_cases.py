"""Rank functions that run the same calls on the portable and the cuda_host backends (test_cuda_host.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import moe_comm


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 or t.dtype in (torch.bfloat16, torch.float16) else t


def _calls(group: dist.ProcessGroup, backend: str, seed: int, config: dict[str, int]) -> list[Any]:
    """Normal-mode and low-latency calls with every optional input, on one backend; every output."""
    R, me = group.size(), group.rank()
    g = torch.Generator().manual_seed(seed * 100 + me)
    T, H, E, K, M = 29 + 3 * me, 512, 4 * R, min(3, 4 * R), 32
    buf = moe_comm.Buffer(group, backend=backend, low_latency_mode=True, explicitly_destroy=True, timeout_s=60,
                          num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, R, E))
    cfg = moe_comm.Config(**config)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    topk[::5, -1] = -1
    w = torch.rand(T, K, generator=g)
    out: list[Any] = []
    rx, rtopk, rw, counts, handle, _ = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E, config=cfg,
                                                    expert_alignment=4)
    out += [rx, rtopk, rw, counts, *handle]
    bias = torch.randn(T, H, generator=g).to(torch.bfloat16)
    y, yw, _ = buf.combine(rx, handle, topk_weights=rw, bias=(bias, bias * 2), config=cfg)
    out += [y, yw]
    # FP8 (x, scales) input, cached, and num_worst_tokens
    q = moe_comm.ops.per_token_cast_to_fp8(x)
    (cx, cs), *_ = buf.dispatch(q, handle=handle, config=cfg)
    out += [cx, cs]
    wx, *_ = buf.dispatch(x.float(), topk_idx=topk, topk_weights=w, num_experts=E, config=cfg,
                          num_worst_tokens=T * R)
    out += [wx]
    for fp8 in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        use_fp8, round_scale, ue8m0 = fp8
        rx_ll, cnt, h_ll, _, hook = buf.low_latency_dispatch(x[:M], topk[:M], M, E, use_fp8=use_fp8,
                                                             round_scale=round_scale, use_ue8m0=ue8m0,
                                                             return_recv_hook=True)
        hook()
        out += [*(rx_ll if use_fp8 else (rx_ll,)), cnt, h_ll[0], h_ll[1]]
        expert_out = torch.randn(E // R, R * M, H, generator=g).to(torch.bfloat16)
        y_ll, _, _ = buf.low_latency_combine(expert_out, topk[:M], w[:M], h_ll)
        out += [y_ll]
    buf.destroy()
    return [_bits(t) if isinstance(t, torch.Tensor) else t for t in out]


def both_backends(group: dist.ProcessGroup, seed: int, config: dict[str, int]) -> list[bool]:
    """Per output of ``_calls``: equal (bitwise) on the portable and the cuda_host backends."""
    a, b = _calls(group, "portable", seed, config), _calls(group, "cuda_host", seed, config)
    return [torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b)]
