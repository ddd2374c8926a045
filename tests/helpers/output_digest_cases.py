"""One fixed program of both modes' calls, inside each rank, reduced to a SHA-256 of every output
byte: the bits the portable backend returns, to compare across commits and transports.

Written against the public ``Buffer`` API only, so the same file runs on earlier commits (that is
how the digests recorded in test_output_digests.py were made)."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

import moe_comm

T, H, K, E, M = 37, 256, 4, 12, 48  # tokens, hidden, top-k, experts (a multiple of 1, 2 and 3 ranks), low-latency M


def _routing(g: torch.Generator, num_tokens: int, num_experts: int) -> torch.Tensor:
    scores = torch.rand(num_tokens, num_experts, generator=g)
    topk = scores.topk(K, dim=1).indices
    topk[torch.rand(num_tokens, K, generator=g) < 0.15] = -1  # some slots select nothing
    return topk


def _feed(h: "hashlib._Hash", *values: object) -> None:
    for v in values:
        if isinstance(v, torch.Tensor):
            h.update(str((v.dtype, tuple(v.shape))).encode())
            h.update(v.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
        elif isinstance(v, (tuple, list)):
            _feed(h, *v)
        elif v is not None:
            h.update(repr(v).encode())


def output_digest(group: dist.ProcessGroup, seed: int) -> str:
    """The SHA-256 of this rank's outputs of: a dispatch with top-k and FP8 scales, a cached
    dispatch, a combine with weights and bias, a padded (num_worst_tokens) dispatch and its
    combine, a BF16 and an FP8 low-latency dispatch and their combines."""
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    h = hashlib.sha256()
    buf = moe_comm.Buffer(group, low_latency_mode=True,
                          num_rdma_bytes=moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, dist.get_world_size(group), E))

    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk_idx = _routing(g, T, E)
    weights = torch.rand(T, K, generator=g)
    n_rank, _, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    _feed(h, n_rank, n_expert, in_rank)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        topk_idx=topk_idx, topk_weights=weights, expert_alignment=4)
    _feed(h, recv_x, recv_idx, recv_w, counts, handle)
    fp8 = (torch.randn(T, H, generator=g).to(torch.float8_e4m3fn), torch.rand(T, H // 128, generator=g))
    cached, *_ = buf.dispatch(fp8, handle=handle)
    _feed(h, cached)
    y = (recv_x.float() * 1.5).to(torch.bfloat16)
    bias = torch.randn(T, H, generator=g).to(torch.bfloat16)
    _feed(h, buf.combine(y, handle, topk_weights=recv_w, bias=bias)[:2])
    padded = buf.dispatch(x, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
                          topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=T * dist.get_world_size(group))
    _feed(h, padded[:5])
    _feed(h, buf.combine(padded[0], padded[4])[:2])

    ll_x = torch.randn(M - 5, H, generator=g).to(torch.bfloat16)
    ll_idx = _routing(g, M - 5, E)
    ll_w = torch.rand(M - 5, K, generator=g)
    for use_fp8 in (False, True):
        recv, count, ll_handle, _, _ = buf.low_latency_dispatch(ll_x, ll_idx, M, E, use_fp8=use_fp8)
        _feed(h, recv, count, ll_handle)
        expert_out = (recv if not use_fp8 else recv[0].float() * 0.5).to(torch.bfloat16)
        _feed(h, buf.low_latency_combine(expert_out, ll_idx, ll_w, ll_handle)[0])
    return h.hexdigest()
